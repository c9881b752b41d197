"""prepfuse inside engines that own Inductor's post-grad hook, one module per engine.

Each module imports its engine and is importable only where the engine is installed;
nothing here is imported by ``import prepfuse``. ``vllm``: ``PrepfuseVllmPass``.
"""
