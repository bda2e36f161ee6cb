//! One demo run: services up, node proxy up (in-process, built-in config), load
//! with a live progress bar, node down, report.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Empty;
use hyper_util::rt::TokioIo;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::demo::config::{self, Backends, ECHO_LISTENER, WEB_LISTENER};
use crate::demo::load::{self, Live, Plan, TcpPlan};
use crate::demo::mtls::{Pki, SECURE_LISTENER};
use crate::demo::report::Report;
use crate::demo::services::DemoServices;
use crate::LabError;

/// How long the node may take to answer 200 on `/ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest accepted `--duration`: the demo is a demo, not a soak test.
const MAX_DURATION: Duration = Duration::from_secs(3600);
/// Bytes per TCP echo round trip and the pause between round trips: a light,
/// steady probe that measures the TCP path without stealing cores from HTTP.
const TCP_PAYLOAD: usize = 64;
const TCP_INTERVAL: Duration = Duration::from_millis(5);

/// What `flatmesh demo` was asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// How long to drive load.
    pub duration: Duration,
    /// Concurrent HTTP keep-alive connections.
    pub connections: usize,
    /// Draw a progress bar on stderr (hidden anyway when stderr is not a terminal).
    pub progress: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            duration: Duration::from_secs(10),
            connections: 8,
            progress: true,
        }
    }
}

impl Options {
    fn validate(&self) -> Result<(), LabError> {
        if self.duration.is_zero() || self.duration > MAX_DURATION {
            return Err(LabError::InvalidOption(format!(
                "--duration must be between 1 and {} seconds",
                MAX_DURATION.as_secs()
            )));
        }
        if !(1..=1024).contains(&self.connections) {
            return Err(LabError::InvalidOption(
                "--connections must be between 1 and 1024".into(),
            ));
        }
        Ok(())
    }
}

/// Run the whole demo and return its report. Check `report.problems()` for the verdict.
/// Blocking: call it from plain threads, not from inside an async runtime (there,
/// use [`load::run`] against a node of your own).
pub fn run(options: &Options) -> Result<Report, LabError> {
    options.validate()?;
    if tokio::runtime::Handle::try_current().is_ok() {
        // Blocking on a new runtime inside another one would panic.
        return Err(LabError::InvalidOption(
            "flatmesh_lab::demo::run blocks and was called inside an async runtime: \
             call it from a plain thread (e.g. spawn_blocking), or use flatmesh_lab::demo::load::run"
                .into(),
        ));
    }
    // Two threads: the demo backends and the load generator share them; the node
    // proxy runs its own workers.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("flatmesh-demo")
        .enable_all()
        .build()
        .map_err(LabError::Runtime)?;
    let services = runtime.block_on(DemoServices::start())?;
    let pki = Pki::create()?;
    let config = config::node_config(
        &Backends {
            api_1: services.api_1,
            api_2: services.api_2,
            canary: services.canary,
            echo: services.echo,
        },
        &pki.listener_yaml("api"),
    )?;

    let node = flatmesh_proxy::Node::start(config, flatmesh_proxy::ConfigSource::Inline)
        .map_err(|e| LabError::NodeStart(e.to_string()))?;
    let web = node
        .listener_addr(WEB_LISTENER)
        .ok_or(LabError::MissingListener(WEB_LISTENER))?;
    let echo = node
        .listener_addr(ECHO_LISTENER)
        .ok_or(LabError::MissingListener(ECHO_LISTENER))?;
    let secure = node
        .listener_addr(SECURE_LISTENER)
        .ok_or(LabError::MissingListener(SECURE_LISTENER))?;
    // The demo's own config puts the admin endpoint on loopback TCP.
    let admin = node
        .admin_addr()
        .tcp()
        .ok_or_else(|| LabError::NodeStart("the demo's admin endpoint is not on TCP".into()))?;
    eprintln!(
        "flatmesh demo: node proxy up: web http://{web}  echo tcp {echo}  secure https://{secure} (mTLS)  admin http://{admin}/metrics"
    );
    eprintln!(
        "flatmesh demo: backends api-1 {}  api-2 {}  canary {} (h2c)  echo {}",
        services.api_1, services.api_2, services.canary, services.echo
    );

    let plan = Plan {
        http_addr: Some(web),
        targets: config::targets(),
        connections: options.connections,
        tcp: Some(TcpPlan {
            addr: echo,
            payload: TCP_PAYLOAD,
            interval: TCP_INTERVAL,
        }),
        duration: options.duration,
    };
    let results = runtime.block_on(async {
        wait_ready(admin, READY_TIMEOUT).await?;
        let results = drive(&plan, options.progress).await?;
        // The mTLS part: four callers, one call each.
        Ok::<_, LabError>((results, pki.calls(secure).await))
    });
    node.shutdown();
    drop(services);
    let (results, mtls) = results?;
    let mut report = Report::new(&results, &config::expectations());
    report.mtls = mtls;
    Ok(report)
}

/// Poll the admin `/ready` endpoint until it answers 200, for at most `within`.
async fn wait_ready(admin: SocketAddr, within: Duration) -> Result<(), LabError> {
    let started = Instant::now();
    let mut last = String::from("no answer yet");
    while started.elapsed() < within {
        match get_status(admin, "/ready").await {
            Ok(StatusCode::OK) => return Ok(()),
            Ok(status) => last = format!("status {status}"),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(LabError::NotReady {
        admin,
        waited: within,
        last,
    })
}

async fn get_status(addr: SocketAddr, path: &str) -> Result<StatusCode, String> {
    let attempt = async {
        let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let request = Request::get(path)
            .header(http::header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        Ok(response.status())
    };
    tokio::time::timeout(Duration::from_secs(1), attempt)
        .await
        .unwrap_or_else(|_| Err("timed out".into()))
}

/// Run the load plan while a progress bar shows elapsed/total time and the live rate.
async fn drive(plan: &Plan, progress: bool) -> Result<load::Results, LabError> {
    let total_ms = plan.duration.as_millis() as u64;
    let bar = if progress {
        ProgressBar::with_draw_target(Some(total_ms), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    let style = ProgressStyle::with_template("{spinner} {bar:30} {msg}")
        .map_err(|e| LabError::Internal(format!("progress bar template: {e}")))?;
    bar.set_style(style);

    let live = Arc::new(Live::default());
    let load = load::run(plan, Arc::clone(&live));
    tokio::pin!(load);
    let started = Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_millis(250));
    let (mut last_count, mut last_at) = (0u64, started);
    let results = loop {
        tokio::select! {
            results = &mut load => break results,
            _ = ticker.tick() => {
                let now = Instant::now();
                let count = live.completed();
                let window = now.duration_since(last_at).as_secs_f64();
                let rate = if window > 0.0 { (count - last_count) as f64 / window } else { 0.0 };
                (last_count, last_at) = (count, now);
                let elapsed = now.duration_since(started).min(plan.duration);
                bar.set_position(elapsed.as_millis() as u64);
                bar.set_message(format!(
                    "{:.1}s / {}s  {:.0} req/s  {} errors",
                    elapsed.as_secs_f64(),
                    plan.duration.as_secs(),
                    rate,
                    live.errors()
                ));
            }
        }
    };
    bar.finish_and_clear();
    results
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_bounded() {
        assert!(Options::default().validate().is_ok());
        for bad in [
            Options {
                duration: Duration::ZERO,
                ..Options::default()
            },
            Options {
                duration: MAX_DURATION + Duration::from_secs(1),
                ..Options::default()
            },
            Options {
                connections: 0,
                ..Options::default()
            },
            Options {
                connections: 5000,
                ..Options::default()
            },
        ] {
            assert!(matches!(bad.validate(), Err(LabError::InvalidOption(_))));
        }
    }

    #[tokio::test]
    async fn run_inside_a_runtime_is_refused_not_a_panic() {
        let result = run(&Options::default());
        assert!(matches!(result, Err(LabError::InvalidOption(m)) if m.contains("spawn_blocking")));
    }

    #[tokio::test]
    async fn ready_when_the_admin_answers_200() -> Result<(), Box<dyn std::error::Error>> {
        // The demo backends answer 200 on every path, /ready included.
        let (addr, task) =
            crate::demo::services::spawn_http("admin", crate::demo::services::HttpVersions::Http1)
                .await?;
        let result = wait_ready(addr, Duration::from_secs(2)).await;
        task.abort();
        result?;
        Ok(())
    }

    #[tokio::test]
    async fn not_ready_names_the_admin_and_the_last_answer(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        drop(listener);
        match wait_ready(addr, Duration::from_millis(200)).await {
            Err(LabError::NotReady { admin, last, .. }) => {
                assert_eq!(admin, addr);
                assert!(last.to_lowercase().contains("refused"), "{last}");
            }
            other => panic!("expected NotReady, got {other:?}"),
        }
        Ok(())
    }
}
