"""tensorfold.adapters: ready hook implementations that families compose (docs/reference.md
describes them; docs/architecture.md says where they sit in a request's path)."""
