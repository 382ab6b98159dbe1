"""integrations — pulsescale inside other people's gateways: hooks that publish the sample contract's
`QueueSample` (docs/gateways.md) from where the requests are.

- `integrations.litellm`: a LiteLLM proxy callback (``pip install 'pulsescale[litellm]'``, docs/litellm.md).

The engine of a hook (`integrations.hook`) counts through `integrations.demand` and publishes with the reference
gateway's publisher; it imports no gateway framework, so it is tested without one. Internal code imports modules
(``from integrations import hook``); nothing is re-exported here, so that importing the package needs no LiteLLM.
"""

__all__: list[str] = []
