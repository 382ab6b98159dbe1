"""The decide side, pure (no NATS, no clock of its own: `now` is passed in): samples and time in, a decision out.

`ingest` folds samples into demand, `detector` sees a pulse, `need` turns arrival rates into replicas, `policy`
decides (its terms in `policystate`, overrides and pauses in `holds`, scale-in windows in `scalein`, when time alone
changes a decision in `settling`), `schedules` raises floors, and `decider` keeps one model's state between them.
"""
