//! Test certificates made with the openssl CLI: a CA, a server certificate for one DNS
//! name and a client certificate, all EC P-256 and valid for a day.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

fn openssl(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("run openssl")?;
    if !output.status.success() {
        bail!(
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// A CA (`ca.crt`), a server certificate for DNS name `server_name` (`server.crt`,
/// `server.key`) and a client certificate (`client.crt`, `client.key`), in `dir`.
pub fn make_certificates(dir: &Path, server_name: &str) -> anyhow::Result<()> {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    openssl(
        dir,
        &[
            &[
                "req",
                "-x509",
                "-days",
                "1",
                "-subj",
                "/CN=test-ca",
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
            ][..],
            &ec[..],
        ]
        .concat(),
    )?;
    let server_extensions =
        format!("subjectAltName=DNS:{server_name}\nextendedKeyUsage=serverAuth\n");
    for (name, extensions) in [
        ("server", server_extensions.as_str()),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ] {
        let subject = format!("/CN={name}");
        let (key, csr, crt, ext) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
            format!("{name}.ext"),
        );
        std::fs::write(dir.join(&ext), extensions)?;
        openssl(
            dir,
            &[
                &["req", "-subj", &subject, "-keyout", &key, "-out", &csr][..],
                &ec[..],
            ]
            .concat(),
        )?;
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                &ext,
                "-out",
                &crt,
            ],
        )?;
    }
    Ok(())
}
