"""The reference models: corpus building, training, the tiny demo models and the KV-variant study."""
