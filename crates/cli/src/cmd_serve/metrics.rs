//! `serve --metrics ADDR`: where the Prometheus endpoint listens (HOST:PORT, or a Unix socket
//! path), and what the info metric says about the export.

use std::net::TcpListener;
use std::path::PathBuf;

use anyhow::{Context, Result};
use cryptbridge_bridge::metrics::{self, http::Endpoint, ExportInfo};

use super::unix_socket;

/// Describes the export and starts the endpoint; returns the Unix socket it created, if any
/// (removed when the server stops).
pub fn start(addr: &str, info: ExportInfo) -> Result<Option<PathBuf>> {
    metrics::global().describe(info);
    // A path has a slash (`./m.sock` for one in the current directory); HOST:PORT never does.
    let (endpoint, created, shown) = if addr.contains('/') {
        let path = PathBuf::from(addr);
        let l = unix_socket::bind(&path, None).context("--metrics")?;
        (Endpoint::Unix(l), Some(path), format!("unix:{addr}"))
    } else {
        let l = TcpListener::bind(addr).with_context(|| format!("--metrics: cannot listen on {addr} (HOST:PORT, or a Unix socket path with a /)"))?;
        let shown = l.local_addr().map_or_else(|_| addr.to_string(), |a| a.to_string());
        (Endpoint::Tcp(l), None, format!("http://{shown}"))
    };
    metrics::http::start(endpoint).context("--metrics: cannot start its thread")?;
    tracing::info!("metrics at {shown}/metrics");
    Ok(created)
}
