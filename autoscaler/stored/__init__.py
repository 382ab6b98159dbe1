"""What the owner of a model keeps in `pulse_leases` beside the leases, so a new owner restores it: on-call
`overrides` and `schedules`, both on one reader of stored `records`.
"""
