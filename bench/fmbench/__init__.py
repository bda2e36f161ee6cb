"""flatmesh side-by-side benchmark harness (issue 3).

One module per concern:
  install    - fetch the peers and load tools on a fresh machine (idempotent)
  scenarios  - the scenario definitions: topology (listeners, routes, clusters), load, checks
  systems    - systems under test: config generation and start commands for each
  procs      - starting pinned processes, readiness, /proc CPU and memory sampling
  loadgen    - running the load tools and parsing their output into one result shape
  backends   - the backend servers (nginx, gRPC echo, sockperf, iperf3)
  runner     - the measurement loop: repeats x scenarios x systems
  report     - JSON, Markdown, SVG plots and the terminal table
"""
