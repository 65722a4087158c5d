//! The public XTS-AES vectors of tests/vectors/xts: Botan's file (IEEE 1619-2007 1-19, NIST)
//! and Wycheproof.

pub struct Vector {
    pub source: String,
    pub key: Vec<u8>,
    pub tweak: Vec<u8>,
    pub plaintext: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

pub fn botan_vectors() -> Vec<Vector> {
    let text = std::fs::read_to_string(super::vectors_dir().join("xts/botan_xts.vec")).unwrap();
    let mut out = Vec::new();
    let mut section = String::new();
    let mut fields: Vec<(String, String)> = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_string();
        } else if let Some((k, v)) = line.split_once(" = ") {
            fields.push((k.to_string(), v.to_string()));
            if k == "Out" {
                let get = |name: &str| hex::decode(&fields.iter().rev().find(|(k, _)| k == name).unwrap().1).unwrap();
                if section.starts_with("[AES-") {
                    out.push(Vector {
                        source: format!("botan {section} #{}", out.len()),
                        key: get("Key"),
                        tweak: get("Nonce"),
                        plaintext: get("In"),
                        ciphertext: get("Out"),
                    });
                }
                fields.clear();
            }
        }
    }
    out
}

pub fn wycheproof_vectors() -> Vec<Vector> {
    let text = std::fs::read_to_string(super::vectors_dir().join("xts/wycheproof_aes_xts_test.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    for group in doc["testGroups"].as_array().unwrap() {
        for t in group["tests"].as_array().unwrap() {
            assert_eq!(t["result"], "valid", "only valid vectors are expected in this file");
            let h = |k: &str| hex::decode(t[k].as_str().unwrap()).unwrap();
            out.push(Vector {
                source: format!("wycheproof tcId {}", t["tcId"]),
                key: h("key"),
                tweak: h("iv"),
                plaintext: h("msg"),
                ciphertext: h("ct"),
            });
        }
    }
    out
}
