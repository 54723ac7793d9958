"""A test-double kernel registered inside the worker processes through a sitecustomize on
PYTHONPATH (the worker has no plugin hook): cumsum attention whose normaliser counts only
half of the carried state's keys, q.(z - z0/2) instead of q.z. The worker's settings check
reads the engine's registry, so registering the kernel is all it takes."""

WRONG_KERNEL = '''
import torch
from fractus.nn import attention


def half_carry_normaliser(q, k, v, S0, z0):
    S = S0.unsqueeze(1) + (k.unsqueeze(-1) * v.unsqueeze(-2)).cumsum(dim=1)
    z = z0.unsqueeze(1) + k.cumsum(dim=1)
    num = torch.matmul(q.unsqueeze(-2), S).squeeze(-2)
    den = (q * (z - 0.5 * z0.unsqueeze(1))).sum(dim=-1)
    return num / (den + 1e-20).unsqueeze(-1), S[:, -1], z[:, -1]


attention.register_attention_impl("halfcarry", half_carry_normaliser)
'''
