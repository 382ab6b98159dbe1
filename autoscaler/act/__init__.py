"""The act side: per model the `scaler` turns a decision into claims, activations and releases on NATS.

`book` holds what the model holds and what is on its way, `slotactions` claims, activates and releases one slot,
`events` publishes what happened, `agentclient` speaks the agents' verbs (typed, stated in the agent's clock).
"""
