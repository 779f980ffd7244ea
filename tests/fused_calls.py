"""A stand-in for a fused-kernel module that counts its qkv_rope / output_mlp calls: which path an Ops
class takes, told apart where the paths agree to rounding (tests/test_forward_seams_behaviour.py,
tests/test_quantized_weights.py)."""


class CountingFused:
    def __init__(self, module):
        self.module, self.calls = module, {"qkv_rope": 0, "output_mlp": 0}

    def __getattr__(self, name):
        def call(*args):
            self.calls[name] += 1
            return getattr(self.module, name)(*args)
        return call
