-- Loaded by bench/run into wrk (-s). After the run it prints one line,
-- "WRKJSON {...}", with the counts, errors and latency percentiles in
-- microseconds, including p99.9 which wrk's own --latency output lacks.
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"lat_us":{"p50":%.1f,"p90":%.1f,"p99":%.1f,"p999":%.1f,"mean":%.1f,"max":%.1f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.mean, latency.max))
end
