"""Starting ranks: ``torchrun`` hand-off for commands (:mod:`~distlab.launch.torchrun`), local
ranks in-process with results back (:mod:`~distlab.launch.spawn`), and an emulated multi-node
cluster of network namespaces, veth links and bridges (:mod:`~distlab.launch.cluster`)."""
