"""serve-tpu: LLM serving on whole TPU hosts and slices with Ray Serve and a JAX engine."""
