"""Framework adapters (DeepSpeed, Megatron-Core), installed as fp8comm.integrations.*."""
