"""Agentic (multi-turn) RL: the tool and environment layer a multi-turn rollout drives.

One concern per module:

* ``tool_call_format``: finding tool calls in a model turn (the Hermes/Qwen
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format; others through
  :data:`~parallel_models.rl.agents.tool_call_format.TOOL_CALL_FORMATS`);
* ``schema``: tools declared as OpenAI function schemas and the check of a call's arguments;
* ``calculator``: the built-in ``calculator`` tool (arithmetic through ``ast``, no ``eval``);
* ``python_sandbox``: the built-in ``python`` tool (a fresh, limited interpreter process);
* ``tools``: the tools by name (:data:`~parallel_models.rl.agents.tools.TOOLS`, built-ins or
  ``path.py:object``);
* ``executor``: running a turn's calls in a thread pool, every failure a tool result, counted;
* ``environment``: the environment interface (``reset`` / ``step``) and its loading.

Nothing here imports torch.
"""
