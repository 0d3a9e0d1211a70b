"""The draft-verify loop, samplers, drafters and one session adapter per backend."""
