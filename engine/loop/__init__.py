"""The device loop: its input (a validated request and what its kind declares about its rows),
its queue of work units, the planning of calls from it, admission, the pins of queries'
pages, failure isolation and recovery, and its metrics. It never imports a request kind."""
