"""The serving stack on top of the model binding (``qwen4exp.vllm``): what a vLLM server running Qwen4Exp adds
beyond the model.

* ``scheduler``: ``AgentScheduler`` (``--scheduler-cls qwen4exp.serving.scheduler.AgentScheduler``), agent sessions
  kept between turns; ``sessions``: their state machine (no vLLM import);
* ``session_api``: ``POST /v1/sessions/{id}/close`` (the ``vllm.endpoint_plugins`` entry ``SessionClosePlugin``);
* ``metrics``: ``AgentStatLogger`` (the ``vllm.stat_logger_plugins`` entry), the scheduler's numbers on ``/metrics``;
* ``tokenize_cache``: the segment-cached prompt tokenization (the ``renderer_tokenize_prompt`` patch);
* ``media``: the ``qwen4exp`` media connector (``VLLM_MEDIA_CONNECTOR=qwen4exp``).

``qwen4exp-serve`` (``qwen4exp.serve``) is the command line over both. The dependency runs one way: this package
imports ``qwen4exp.vllm`` (its patch registry, the architecture names); the model binding reaches this package only
lazily, through the patch registry's ``"module:function"`` entries and, for the media connector, ``register()`` when
``VLLM_MEDIA_CONNECTOR`` selects it (``tests/test_import_graph.py``). Nothing is imported here: each module is
loaded where it is used (vLLM entry points, the engine core, the API server).
"""
