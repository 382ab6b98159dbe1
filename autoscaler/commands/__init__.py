"""On-call commands (``pulse.cmd.<verb>``): `service` routes a request to the replica owning its model, remembers
and audits it; `verbs` act, `status` reads the rows, `base` holds the terms they share.
"""
