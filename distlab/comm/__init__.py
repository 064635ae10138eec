"""Communication: collectives and their byte accounting (point-to-point algorithms arrive with the
collectives issue; for now only the analytic volumes of torch's native collectives)."""
