"""tensorfold.adapters: ready hook implementations that families compose."""
