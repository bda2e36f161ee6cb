//! `flatmesh shm run -- CMD ...`: runs CMD with the hetero-socket library (`libflatmesh_shm.so`,
//! built from crates/shm) preloaded, so CMD's local TCP connections to other preloaded
//! programs move their data path to shared memory. `flatmesh shm status` shows the shared
//! arenas and which processes hold records in them. See docs/shm.md.

use anyhow::{bail, Context};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

const LIBRARY: &str = "libflatmesh_shm.so";

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: ShmCommand,
}

#[derive(clap::Subcommand)]
enum ShmCommand {
    /// Run a command with the shared-memory socket library preloaded (LD_PRELOAD).
    ///
    /// The library is looked up in FLATMESH_SHM_LIB, then next to the flatmesh binary. The
    /// FLATMESH_SHM_* variables tune it (docs/shm.md); bad values are refused here.
    Run {
        /// The command and its arguments (put them after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Show this user's shared arenas: size, free records, and the processes holding records.
    Status,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        ShmCommand::Run { command } => run_preloaded(&command),
        ShmCommand::Status => status(),
    }
}

/// Where the library is: FLATMESH_SHM_LIB, else next to this binary.
pub(crate) fn find_library() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("FLATMESH_SHM_LIB") {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("FLATMESH_SHM_LIB points to {}, which is not a file: build the library with `cargo build --release -p flatmesh-shm` and point it at target/release/{LIBRARY}", path.display());
        }
        return Ok(path);
    }
    let exe = std::env::current_exe().context("cannot find the flatmesh binary's own path")?;
    let dir = exe
        .parent()
        .context("the flatmesh binary has no parent directory")?;
    let path = dir.join(LIBRARY);
    if !path.is_file() {
        bail!(
            "{LIBRARY} is not next to {}: build it with `cargo build --release -p flatmesh-shm` (it lands in the same target directory), or set FLATMESH_SHM_LIB to its path",
            exe.display()
        );
    }
    Ok(path)
}

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *const c_char;
}
const RTLD_NOW: c_int = 2;
const RTLD_LOCAL: c_int = 0;

/// Loads the library privately (RTLD_LOCAL: its socket functions do not replace this
/// process's) and calls one of its report functions, `fn(buffer, len) -> full length`.
/// `Ok(None)`: the library is too old to have it.
fn ask_library(library: &Path, symbol: &str) -> anyhow::Result<Option<String>> {
    let path = CString::new(library.as_os_str().as_encoded_bytes())
        .context("the library path contains a NUL byte")?;
    let name = CString::new(symbol).context("symbol name")?;
    // SAFETY: dlopen/dlsym with NUL-terminated strings; the symbol is one of the library's
    // exported report functions with the signature below; the buffer outlives the call.
    unsafe {
        let handle = dlopen(path.as_ptr(), RTLD_NOW | RTLD_LOCAL);
        if handle.is_null() {
            let reason = dlerror();
            let reason = if reason.is_null() {
                "unknown error".into()
            } else {
                CStr::from_ptr(reason).to_string_lossy()
            };
            bail!(
                "cannot load {}: {reason}; rebuild it with `cargo build --release -p flatmesh-shm`",
                library.display()
            );
        }
        let function = dlsym(handle, name.as_ptr());
        if function.is_null() {
            return Ok(None);
        }
        let report: unsafe extern "C" fn(*mut c_char, usize) -> isize =
            std::mem::transmute(function);
        let mut buffer = vec![0u8; 1 << 16];
        let len = report(buffer.as_mut_ptr().cast(), buffer.len());
        if len < 0 {
            bail!("{symbol} in {} failed", library.display());
        }
        if len as usize >= buffer.len() {
            buffer = vec![0u8; len as usize + 1];
            report(buffer.as_mut_ptr().cast(), buffer.len());
        }
        buffer.truncate((len as usize).min(buffer.len()));
        Ok(Some(String::from_utf8_lossy(&buffer).into_owned()))
    }
}

fn run_preloaded(command: &[String]) -> anyhow::Result<()> {
    let Some((program, arguments)) = command.split_first() else {
        bail!("no command given: use `flatmesh shm run -- CMD [ARGS...]`");
    };
    let library = find_library()?;
    let library = library.canonicalize().unwrap_or(library);
    // The library itself falls back to defaults on bad values (it cannot refuse inside an
    // unmodified program); here we can, with its own rules.
    if let Some(problems) = ask_library(&library, "flatmesh_shm_check_env")? {
        if !problems.trim().is_empty() {
            bail!(
                "bad shared-memory settings (see docs/shm.md, \"Settings\"):\n{}",
                problems.trim_end()
            );
        }
    }
    // Keep whatever the caller already preloads; ours goes first.
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(existing) if !existing.trim().is_empty() => format!("{}:{existing}", library.display()),
        _ => library.display().to_string(),
    };
    // exec replaces this process, so exit status and signals are CMD's own.
    let error = std::process::Command::new(program)
        .args(arguments)
        .env("LD_PRELOAD", preload)
        .exec();
    Err(error).with_context(|| format!("cannot run `{program}`: is it installed and on PATH?"))
}

fn status() -> anyhow::Result<()> {
    let library = find_library()?;
    match ask_library(&library, "flatmesh_shm_status")? {
        Some(report) => {
            print!("{report}");
            Ok(())
        }
        None => bail!(
            "{} has no status report: it is older than this flatmesh; rebuild it with `cargo build --release -p flatmesh-shm`",
            library.display()
        ),
    }
}
