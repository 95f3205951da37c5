"""The engine: admission queue, scheduler, engine loop and executors.

It never imports the web framework, and only the executor touches a pipeline.
"""
