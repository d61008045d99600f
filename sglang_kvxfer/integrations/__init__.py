"""Adapters that let inference servers use this engine as their KV transfer backend.

``integrations.sglang`` subclasses SGLang's disaggregation base classes (it imports
SGLang); ``integrations.sglang_args`` translates SGLang's ``KVArgs`` without importing it;
``integrations.sglang_install`` adds the ``kvxfer`` backend to SGLang's backend lookup.
Importing this package imports none of them.
"""
