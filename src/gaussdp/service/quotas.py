"""Per-tenant quotas of what the service keeps for a tenant, and its memory for CKKS contexts.

Each is checked before anything is stored (or charged): a refusal is 429 ``quota_exceeded`` naming
the quota (``capacity_exceeded`` when the server's whole CKKS memory is in use by other tenants:
no tenant's upload evicts another tenant's context).

==============================  ===========================================  =================
quota                           what it bounds                               default
==============================  ===========================================  =================
``max_corpora_per_tenant``      corpora stored for the tenant                100
``max_corpus_bytes_per_tenant``  their bytes, together                       2,000,000,000
``max_jobs_per_tenant``         its fine-tuning jobs not yet finished        4
``ckks_tenant_memory_bytes``    its loaded CKKS contexts, per worker         134,217,728 (128 MiB)
``ckks_memory_bytes``           every tenant's loaded contexts, per worker   536,870,912 (512 MiB)
==============================  ===========================================  =================
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Quotas"]


@dataclass(frozen=True)
class Quotas:
    """The per-tenant quotas (``gaussdp serve`` options of the same names); each must be >= 0."""

    max_corpora_per_tenant: int = 100
    max_corpus_bytes_per_tenant: int = 2_000_000_000
    max_jobs_per_tenant: int = 4
    ckks_tenant_memory_bytes: int = 128 << 20
    ckks_memory_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{f.name} must be an integer >= 0, got {f.name}={value!r}")
        if self.ckks_tenant_memory_bytes > self.ckks_memory_bytes:
            raise ValueError(
                f"ckks_tenant_memory_bytes={self.ckks_tenant_memory_bytes} is more than "
                f"ckks_memory_bytes={self.ckks_memory_bytes} (the server's whole budget)"
            )
