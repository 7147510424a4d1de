"""Inference engines: the registry (name -> builder + capabilities), the launcher, one command builder per engine, and engine-check."""
