"""A bench session (`Bench`): the measured server or engine, the model's shapes and the workload
sizes from the `bench` arguments; which backend each workload is sent to; the server's CPU time."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from prefixscore.bench import workloads as wl
from prefixscore.bench.backends import Backend, InProcess, Remote, RemoteClassify, RemoteRerank
from prefixscore.bench.metrics import scrape, thread_cpu, token_counts
from prefixscore.bench.processes import ServedProcess, warmed_up
from prefixscore.bench.provenance import commit, machine
from prefixscore.bench.timing import Peak
from prefixscore.model.head import output_head
from prefixscore.telemetry import host_cost


class Bench:
    """One bench session: where its requests go (a `prefixscore serve` process of its own, a remote
    --target, or the engine built here, in process and served on free ports when a workload needs
    gRPC or HTTP), what is known of the model (its shapes for FLOPs, its labels) and the workload
    sizes; measure.py times workloads against it, soak.py and spill.py drive their traffic at it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.scorer: Any = None
        self.server: Any = None
        self.peak: Peak | None = None
        self.served: ServedProcess | None = None
        self.metrics_target, self.http_target = args.metrics_target, args.http_target
        if args.serve_process:
            self.served = ServedProcess(args)
            args.target = self.served.target
            self.metrics_target, self.http_target = self.served.metrics_target, self.served.http_target
        self.remote: Remote | None = Remote(args.target) if args.target else None
        if self.remote is None:
            from prefixscore.engine.build import EngineSpec, build_engine
            from prefixscore.engine.scorer import Scorer

            spec = EngineSpec.from_options(vars(args), devices=args.devices)
            built = build_engine(spec)
            loaded = built.model
            self.scorer = Scorer(loaded, built.engine, template=args.template)
            self.cfg = loaded.cfg
            self.tokenizer = loaded.tokenizer
        else:
            from prefixscore.model import presets

            info = warmed_up(self.remote.client)
            self.model_info = info
            # FLOPs need the shapes: known for presets (a served directory reports no config)
            preset = presets.RANDOM_PRESETS.get(info.model)
            self.cfg = preset[0] if preset else None
            self.tokenizer = None
        self.sizes = wl.Sizes(
            w1_query=args.query_tokens,
            w1_items=args.items,
            w1_item_tokens=args.item_tokens,
            sequential_items=args.sequential_items,
            w2_requests=args.w2_requests,
            w2_concurrency=args.concurrency,
            **wl.w2_ranges(args.w2_max_query, args.w2_max_items, args.w2_max_item_tokens),
            w3_docs=args.w3_docs,
            w3_doc_tokens=(min(50, args.w3_max_doc_tokens), args.w3_max_doc_tokens),
            w3_requests=args.w3_requests,
            w4_requests=args.w4_requests,
            w4_concurrency=args.w4_concurrency,
            w4_query=args.w4_query_tokens,
            w4_items=args.w4_items,
            w4_item_tokens=args.w4_item_tokens,
            w6_conversation=args.w6_conversation,
            w6_responses=args.w6_responses,
            w6_response_tokens=(min(50, args.w6_max_response_tokens), args.w6_max_response_tokens),
        )

    @property
    def vocab(self) -> int:
        if self.cfg is not None:
            return self.cfg.vocab_size
        return int(self.model_info.vocab_size)

    def context(self) -> dict[str, Any]:
        """The configuration printed with every result."""
        import jax

        if self.scorer is not None:
            engine = self.scorer.engine
            return {
                "model": self.args.model,
                "dtype": self.args.dtype,
                **quantization(self.args.quantize, self.args.activations, self.scorer.model.quantization),
                "backend": jax.default_backend(),
                "device_kind": jax.devices()[0].device_kind,
                "devices": engine.n_devices,
                "tp_size": engine.layout.shape.model,
                "dp_size": engine.layout.shape.data,
                "attention": engine.attn_impl,
                "buckets": dataclasses.asdict(engine.buckets),
                "target": "in-process",
                "commit": commit(),
                "machine": machine(),
                "jax": jax.__version__,
            }
        info = self.model_info
        return {
            "model": info.model,
            "dtype": info.dtype,
            **quantization(None, None, _served_quantization(info)),
            "backend": "remote",
            "device_kind": ", ".join(info.devices),
            "devices": len(info.devices),
            "attention": info.attention,
            "target": self.args.target,
            "commit": commit(),
            "machine": machine(),
        }

    @property
    def labels(self) -> list[int]:
        # a classifier takes no label ids: its head scores every label
        owns_rows = self.cfg is not None and output_head(self.cfg).own_rows
        return [] if owns_rows else wl.label_ids(self.vocab, self.tokenizer)

    def requests(self, workload: str, n: int, gen: wl.Generator) -> list[wl.Request]:
        if workload.startswith("w6"):
            return wl.w6(gen, self.sizes, n)
        labels = self.labels
        if workload.startswith("w1"):
            return wl.w1(gen, self.sizes, labels, cold=workload == "w1-cold", runs=n)
        if workload == "w2":
            return wl.w2(gen, self.sizes, labels, n)
        if workload in ("w4", "host"):
            return wl.w4(gen, self.sizes, labels, n)
        if workload == "host-rerank":
            return wl.rerank_texts(gen, n, self.args.rerank_docs)  # type: ignore[return-value]
        if workload == "w5":  # n: W1-sized queries (and the W2-shaped hot requests)
            return wl.w5(gen, self.sizes, labels, n, self.args.w5_chunk, self.args.w5_hot_requests)
        return wl.w3(gen, self.sizes, labels, n)

    def concurrency(self, workload: str) -> int | None:
        """Clients at once for a concurrent workload; None: one request at a time."""
        return {
            "w2": self.sizes.w2_concurrency,
            "w3-grpc": self.sizes.w2_concurrency,
            "w4": self.sizes.w4_concurrency,
            "host": self.sizes.w4_concurrency,
            "host-rerank": self.sizes.w4_concurrency,
            "w5": self.sizes.w2_concurrency,
        }.get(workload)

    def flops(self, req: wl.Request, cached: int) -> int:
        """Model FLOPs of a request whose first `cached` query tokens came from the prefix cache."""
        if self.cfg is None or isinstance(req, wl.RerankTexts):  # text: its tokens are the server's
            return 0
        from prefixscore.model import flops

        lens = [len(it) for it in req.items]
        total = flops.request(self.cfg, len(req.query), lens, req.apply_softmax, len(req.labels))["total"]
        # A partial hit (W3's shared header) still prefills the rest of the query: take off only the
        # cached part's prefill, so a hit on 60 header tokens is not booked as a whole query saved.
        cached = min(cached, len(req.query))
        return total - flops.request(self.cfg, cached, [], req.apply_softmax, len(req.labels))["prefill"]

    def target(self, workload: str, mode: str = "prefix") -> Backend:
        if workload == "w5":
            if self.args.target is None:
                raise SystemExit("w5 runs through a router in front of replicas: --target ROUTER --replica-metrics")
            return Remote(self.args.target, prefix_key=mode == "affinity")
        if workload == "host-rerank":
            if self.http_target is None and self.remote is None:
                self._local_server()
            if self.http_target is None:
                raise SystemExit("host-rerank needs an HTTP API: --serve-process, or --target with --http-target")
            return RemoteRerank(self.http_target)
        if workload == "w6" and mode != "prefix":  # the baselines: in process, as W1's
            return InProcess(self.scorer)
        if workload.startswith("w6"):
            if self.http_target is None and self.remote is None:
                self._local_server()
            if self.http_target is None:
                raise SystemExit("w6 needs an HTTP API: --serve-process, or --target with --http-target")
            return RemoteClassify(self.http_target, one_by_one=workload == "w6-one-by-one")
        if self.remote is not None:
            return self.remote
        if workload not in wl.CONCURRENT:
            return InProcess(self.scorer)
        return self._local_server()

    def _local_server(self) -> Remote:
        """W2/W3-grpc/W4 (and host, host-rerank) without a target are measured through gRPC (and
        HTTP): this engine served on free ports in this process."""
        if self.server is None:
            from prefixscore.service.core import ServerConfig
            from prefixscore.service.process import ServerThread

            cfg = ServerConfig(
                host="127.0.0.1",
                port=0,
                metrics_port=None,
                http_port=0,
                warmup=False,
                template=self.args.template,
                loaded=self.scorer.model,
                engine=self.scorer.engine,
            )
            server = ServerThread(cfg).start()
            try:
                self.local_remote = Remote(server.target)
            except BaseException:
                server.stop()
                raise
            self.server = server
            self.http_target = f"127.0.0.1:{server.server.http_port}"
        return self.local_remote

    def token_counts(self) -> dict[str, float] | None:
        """The tokens computed and requested so far (bench/metrics.py `token_counts`): by the engine
        built here (its in-process loop and, when served here, its server's), or the target's
        metrics endpoint; None when neither is known."""
        if self.scorer is not None:
            loops = [self.scorer.runner.worker.metrics]
            if self.server is not None:
                loops.append(self.server.server.service.metrics)
            requested = sum(m.registry.get_sample_value("prefixscore_requested_tokens_total") or 0.0 for m in loops)
            stats = self.scorer.engine.stats
            return {
                "computed": float(stats["computed_tokens"]),
                "buckets": float(stats["device_tokens"]),
                "requested": requested,
            }
        return token_counts(scrape(self.metrics_target)) if self.metrics_target else None

    def host_cpu(self) -> dict[str, float] | None:
        """The server's CPU seconds so far by thread kind: from its pid (--target-pid) or its
        metrics endpoint; None when neither is known (a server in this process is not measured:
        the bench's client threads would count too)."""
        if self.args.target_pid:
            pid = self.args.target_pid
            return host_cost.seconds_by_kind(pid, host_cost.interpreter_thread_ids(pid))
        return thread_cpu(self.metrics_target) if self.metrics_target else None

    def close(self) -> None:
        if self.server is not None:
            self.local_remote.close()
            self.server.stop()
        if self.remote is not None:
            self.remote.close()
        if self.served is not None:
            self.served.close()


def quantization(quantize: str | None, activations: str | None, served: dict[str, Any]) -> dict[str, Any]:
    """What a record says of the projections: the --quantize and --activations asked for (None:
    a remote server's, not known) and what the load made of them ({"weights": "int8",
    "activations": "dynamic"}; {"weights": "none"}: nothing 8-bit)."""
    return {
        "quantize": quantize,
        "activations": activations,
        "quantization": {k: v for k, v in served.items() if k in ("weights", "activations")},
    }


def _served_quantization(info: Any) -> dict[str, Any]:
    """A remote server's quantization from its GetModelInfo (an older server reports none)."""
    weights = getattr(info, "quantization", "") or "none"
    served: dict[str, Any] = {"weights": weights}
    if getattr(info, "activation_quantization", ""):
        served["activations"] = info.activation_quantization
    return served
