"""Where a cluster run happens: the Ray cluster's address, the rendezvous host and the network interfaces.

A `Site` holds what differs between clusters running the same preset (the seed's `export MASTER_ADDR=...`
lines). Launch plans render a missing value as a `${VAR}` reference; a job that is about to be submitted calls
`Site.require(profile)`, which names every missing value by its deployment parameter and how to set it.

    site = Site(ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1", socket_ifname="ens50f0")
    site.require(get_profile("mi355x"))   # SiteError naming ib_hca
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.profiles import HardwareProfile


class SiteError(ValueError):
    """A site value the cluster job needs is missing; the message names the deployment parameter."""


# deployment parameter (flows/params.py) -> (environment variable, what it is)
SITE_PARAMETERS: dict[str, tuple[str, str]] = {
    "ray_address": ("RAY_ADDRESS", "the Ray Jobs API of the existing cluster, e.g. http://10.0.0.1:8265"),
    "master_addr": ("MASTER_ADDR", "the torch.distributed rendezvous host (usually the Ray head's IP)"),
    "socket_ifname": ("NCCL_SOCKET_IFNAME", "the NIC for NCCL/RCCL, Gloo and tensorpipe bootstrap traffic"),
    "ib_hca": ("NCCL_IB_HCA", "the RDMA devices NCCL/RCCL may use, e.g. rdma0,rdma1"),
}


@dataclass(frozen=True, kw_only=True)
class Site:
    """Site-specific values of the seed's `export`s and `ray start` lines; None renders as a ${VAR} reference."""

    head_ip: str | None = None
    """$HEAD_IP: node 0, Ray head and Miles driver."""
    worker_ips: tuple[str, ...] = ()
    """$WORKER_IP of nodes 1.. in order (Miles sorts placement bundles by node IP, so list them sorted)."""
    master_addr: str | None = None
    """MASTER_ADDR (torch.distributed rendezvous); None = head_ip."""
    ray_address: str | None = None
    """RAY_ADDRESS the Miles job is submitted to; None = http://<head_ip>:8265 (the Ray Jobs API)."""
    socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME: the NIC for bootstrap traffic."""
    gloo_socket_ifname: str | None = None
    """GLOO_SOCKET_IFNAME; defaults to socket_ifname."""
    tp_socket_ifname: str | None = None
    """TP_SOCKET_IFNAME (tensorpipe / RPC); defaults to socket_ifname."""
    ib_hca: str | None = None
    """NCCL_IB_HCA: the RDMA devices RCCL/NCCL may use (e.g. "rdma0,rdma1,...")."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More cluster-wide variables; they reach every rank through the job's runtime env."""
    python: str = "python3"
    """The interpreter that runs train.py on the cluster's nodes (Miles' launcher submits `python3`); a path where
    the nodes' Python with Miles installed is not the first python3 on PATH."""
    ray_cli: str = "ray"
    """The `ray` command this host submits and stops jobs with (a path where it is not on PATH, e.g. a venv's)."""

    def ip(self, node: int) -> str:
        if node == 0:
            return self.head_ip or "${HEAD_IP}"
        return self.worker_ips[node - 1] if node - 1 < len(self.worker_ips) else f"${{WORKER_IP_{node}}}"

    @property
    def resolved_ray_address(self) -> str | None:
        return self.ray_address or (f"http://{self.head_ip}:8265" if self.head_ip else None)

    @property
    def resolved_master_addr(self) -> str | None:
        return self.master_addr or self.head_ip

    def network_env(self, profile: HardwareProfile) -> dict[str, str]:
        """The interface/HCA variables the profile needs, with this site's values (${VAR} when unset).

        Miles' launcher forwards only NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME into the Ray runtime env
        (conformance A10); the job puts all of these there, so every rank gets them whatever `ray start` saw.
        """
        values = {"NCCL_SOCKET_IFNAME": self.socket_ifname,
                  "GLOO_SOCKET_IFNAME": self.gloo_socket_ifname or self.socket_ifname,
                  "TP_SOCKET_IFNAME": self.tp_socket_ifname or self.socket_ifname, "NCCL_IB_HCA": self.ib_hca}
        return {key: values[key] or f"${{{key}}}" for key in values if key in profile.site_env}

    def env(self, profile: HardwareProfile) -> dict[str, str]:
        """The seed's exports, in its order: rendezvous, external Ray, unbuffered logs, interfaces, HCAs, GID."""
        env = {"MASTER_ADDR": self.resolved_master_addr or "${MASTER_ADDR}", "MILES_SCRIPT_EXTERNAL_RAY": "1",
               "RAY_ADDRESS": self.resolved_ray_address or "${RAY_ADDRESS}", "PYTHONUNBUFFERED": "1"}
        return {**env, **self.network_env(profile), **profile.comm_env, **self.extra_env}

    def missing(self, profile: HardwareProfile) -> list[str]:
        """The deployment parameters this site lacks for a job on `profile` (empty when it can be submitted)."""
        have = {"ray_address": self.resolved_ray_address, "master_addr": self.resolved_master_addr,
                "socket_ifname": self.socket_ifname, "ib_hca": self.ib_hca}
        needed = ["ray_address", "master_addr"] + [p for p in ("socket_ifname", "ib_hca")
                                                   if SITE_PARAMETERS[p][0] in profile.site_env]
        return [p for p in needed if not have[p]]

    def require(self, profile: HardwareProfile) -> "Site":
        """Self, or SiteError naming each missing deployment parameter, its variable and what to put there."""
        missing = self.missing(profile)
        if missing:
            lines = [f"  {p} ({SITE_PARAMETERS[p][0]}): {SITE_PARAMETERS[p][1]}" for p in missing]
            raise SiteError(f"the cluster job on {profile.name} needs these site parameters, unset:\n"
                            + "\n".join(lines) + "\nset them in the deployment's parameters (flows/params.py "
                            "PipelineParams) or `v4rl plan --ray-address ... --master-addr ... --ifname ... "
                            "--ib-hca ...`; nothing was submitted")
        return self
