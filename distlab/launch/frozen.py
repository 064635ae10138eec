"""Imported last by a server that forks workers (the prefork server, ``run_ranks``' fork server): everything the
imports before it made is moved out of the garbage collector's reach (``gc.freeze``).

A forked worker shares the server's heap copy-on-write. A full collection -- every rank makes one at its end
(:func:`distlab.runtime.shutdown`), and the collector makes them as a run allocates -- would walk every object
of that heap, touching each (so copying its page) and costing a rank ~0.2 s of CPU for torch's modules alone;
frozen, a worker's collections walk only what the worker made. Nothing frozen is ever freed: it is the
modules' own state, which lives as long as the process anyway. Import this module only in such a server.
"""

import gc

gc.collect()  # what the imports left as garbage goes first: frozen, it would stay
gc.freeze()
