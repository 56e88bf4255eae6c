"""The engine's settings, in one place for the compiler and the runtime alike: `EngineConfig` and
its defaults (`engine_config.py`), the one table of engine flags every command line shares
(`flags.py`), and docs/configuration.md generated from both (`doc.py`)."""
