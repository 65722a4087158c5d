//! `serve --vhost-user-blk SOCKET`: the volume as a vhost-user-blk device instead of an NBD
//! export (the bridge's `frontend/vhost_user`). The socket is made as `--unix`'s is (0600,
//! whatever the umask); the ready line is `ready vhost-user-blk:ABSOLUTE-PATH`.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use cryptbridge_bridge::{serve_vhost_user_blk, Mapping, Server, VhostUserOptions};
use cryptbridge_engine::RtlSimBackend;

use super::{install_signal_handler, report_simulation_speed, unix_socket, Args, CreatedFiles};

#[allow(clippy::too_many_arguments)]
pub(super) fn serve(
    args: &Args,
    path: &Path,
    server: &Arc<Server>,
    mapping: Arc<Mapping>,
    rtl: Option<Arc<RtlSimBackend>>,
    reencryption: Option<Arc<super::reencrypt::Job>>,
    mut created: CreatedFiles,
    mode: &str,
) -> Result<ExitCode> {
    let listener = unix_socket::bind(path, None)?;
    created.socket = Some(path.to_path_buf());
    let abs = std::fs::canonicalize(path)?;
    let sockets = [created.socket.clone(), created.metrics.clone()].into_iter().flatten().collect();
    install_signal_handler(Arc::clone(&mapping), sockets, rtl.clone(), reencryption)?;
    if let Some(sim) = rtl {
        report_simulation_speed(sim);
    }
    let options = VhostUserOptions { queues: usize::from(args.queues), serial: args.export_name.clone() };
    tracing::info!(
        "serving {} ({} bytes, {}-byte sectors, {mode}) as vhost-user-blk on {}, {} queue(s)",
        args.backing.display(),
        mapping.size(),
        mapping.sector_size(),
        abs.display(),
        options.queues,
    );
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "ready vhost-user-blk:{}", abs.display()).and_then(|()| out.flush()).context("cannot print the ready line on stdout")?;
    }
    created.backing = None;
    // The socket stays for the signal handler to remove; a failing listener removes it here.
    serve_vhost_user_blk(server, listener, &options).context("vhost-user-blk")?;
    Ok(ExitCode::SUCCESS)
}
