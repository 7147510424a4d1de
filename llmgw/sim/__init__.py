"""The built-in simulated engine ``sim``: its OpenAI-compatible server and its multi-node rendezvous."""
