//! dm-crypt's old IV modes at each level: the known answers from Python `cryptography`
//! (tests/data/ivmodes_kat.txt), one unit at a time and as runs of units (the engine's call).

use cryptbridge_cipher::ivmodes::{Cbc, Essiv, Plain32};
use cryptbridge_cipher::xts::Xts;
use cryptbridge_cipher::{CpuLevel, SectorCipher};
use libtest_mimic::Failed;

use crate::common::ivmodes::{kats, plaintext};
use crate::{ensure, Check};

pub const CASES: &[(&str, Check)] = &[("ivmodes_known_answers", known_answers)];

fn build(name: &str, key: &[u8], level: CpuLevel) -> Result<Box<dyn SectorCipher>, Failed> {
    Ok(match name {
        "essiv(cbc(aes),sha256)" => Box::new(Essiv::with_level("essiv(cbc(aes),sha256)", key, Cbc::with_level(key, level)?, level)?),
        "cbc(aes)" => Box::new(Cbc::with_level(key, level)?),
        "xts(aes)-plain" => Box::new(Plain32::new(Xts::with_level(key, level)?)),
        "essiv(xts(aes),sha256)" => Box::new(Essiv::with_level("essiv(xts(aes),sha256)", key, Xts::with_level(key, level)?, level)?),
        other => return Err(format!("unknown scheme {other}").into()),
    })
}

fn known_answers(level: CpuLevel) -> Result<(), Failed> {
    for k in &kats() {
        let c = build(&k.name, &k.key, level)?;
        ensure(c.name() == k.name, || format!("{} is called {}", k.name, c.name()))?;
        let data = plaintext(k.unit);
        let mut buf = data.clone();
        c.encrypt_unit(k.sector, &mut buf)?;
        k.check(&buf, "encrypt_unit")?;
        c.decrypt_unit(k.sector, &mut buf)?;
        ensure(buf == data, || format!("{}: decrypt_unit", k.name))?;
        let three = [data.clone(), data.clone(), data.clone()].concat();
        let mut run = three.clone();
        c.encrypt_units(k.sector.wrapping_sub(8), 8, k.unit, &mut run)?;
        k.check(&run[k.unit..2 * k.unit], "middle of a step-8 run")?;
        c.decrypt_units(k.sector.wrapping_sub(8), 8, k.unit, &mut run)?;
        ensure(run == three, || format!("{}: decrypt_units", k.name))?;
    }
    Ok(())
}
