"""Engine <-> transfer-agent glue for P/D disaggregation (engine-agnostic core).

``base`` is the hook contract; ``scheduler``/``worker`` implement it on the transfer agent
(push and pull); ``factory.build_connectors`` builds the pair for one engine.
"""
