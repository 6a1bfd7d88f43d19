"""What an engine is asked to be: the model's configuration, the engine's settings, the variant (VariantSpec),
sampling parameters, the named presets and the recorded static-best. Imports nothing of the engine above it."""
