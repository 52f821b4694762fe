//! Refuses a JSON array where the contract documents an object.
//!
//! serde's derive reads a struct from a JSON array as readily as from an object (the fields
//! in order), so without this check `"source": [null, null]` would be a volume source with no
//! fields set and `"pool": ["default", "ci"]` a pool reference. The documented shape is the
//! body type's own OpenAPI schema (the one `/openapi.json` serves), so what is refused is
//! exactly what the document says is not an object. Only that one leniency is checked here:
//! every other type mismatch serde refuses by itself.
//!
//! A body without a `[` contains no array and is not walked, so the common claim body costs
//! nothing. Must never refuse a body the schema accepts.

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use serde_json::{Map, Value};
use utoipa::ToSchema;

/// A body type's schema and the component schemas it refers to, as JSON.
struct Shape {
    root: Value,
    components: Map<String, Value>,
}

fn shape_of<T: ToSchema + 'static>() -> Arc<Shape> {
    static SHAPES: LazyLock<Mutex<HashMap<TypeId, Arc<Shape>>>> = LazyLock::new(Mutex::default);
    let mut shapes = SHAPES.lock().expect("shape cache poisoned");
    shapes
        .entry(TypeId::of::<T>())
        .or_insert_with(|| {
            let mut refs = vec![];
            T::schemas(&mut refs);
            let mut components: Map<String, Value> =
                refs.into_iter().map(|(name, s)| (name, serde_json::to_value(s).unwrap_or_default())).collect();
            let root = serde_json::to_value(T::schema()).unwrap_or_default();
            components.insert(T::name().into_owned(), root.clone());
            Arc::new(Shape { root, components })
        })
        .clone()
}

/// `Err` names the first place in `body` where an array stands for a documented object.
pub(super) fn check<T: ToSchema + 'static>(body: &[u8]) -> Result<(), String> {
    if !body.contains(&b'[') {
        return Ok(());
    }
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return Ok(()); // Not JSON: the caller's parse already answered that.
    };
    let shape = shape_of::<T>();
    Walk { components: &shape.components }.value(&value, &shape.root, "body", 0)
}

struct Walk<'a> {
    components: &'a Map<String, Value>,
}

/// Deeper than any documented body; a hostile nesting stops being walked here.
const MAX_DEPTH: usize = 64;

impl Walk<'_> {
    /// The schema a `$ref` names (unknown ones: none, so nothing is checked against them).
    fn resolve<'s>(&'s self, mut s: &'s Value) -> Option<&'s Value> {
        for _ in 0..MAX_DEPTH {
            match s.get("$ref").and_then(Value::as_str) {
                Some(r) => s = self.components.get(r.rsplit('/').next().unwrap_or(r))?,
                None => return Some(s),
            }
        }
        None
    }

    fn is_object_schema(&self, s: &Value) -> bool {
        self.resolve(s)
            .is_some_and(|s| types(s).is_some_and(|t| t.contains(&"object")) || s.get("properties").is_some())
    }

    /// Whether the schema's declared `type` admits the value's JSON type (no `type`: any).
    fn admits(&self, v: &Value, s: &Value) -> bool {
        let Some(s) = self.resolve(s) else { return true };
        let Some(ts) = types(s) else { return true };
        let t = json_type(v);
        ts.contains(&t) || (t == "integer" && ts.contains(&"number"))
    }

    fn value(&self, v: &Value, s: &Value, path: &str, depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Ok(());
        }
        let Some(s) = self.resolve(s) else { return Ok(()) };
        if let Some(all) = s.get("allOf").and_then(Value::as_array) {
            for part in all {
                self.value(v, part, path, depth + 1)?;
            }
        }
        for key in ["oneOf", "anyOf"] {
            if let Some(alts) = s.get(key).and_then(Value::as_array) {
                let candidates: Vec<&Value> = alts.iter().filter(|a| self.admits(v, a)).collect();
                if candidates.is_empty() {
                    if v.is_array() && alts.iter().any(|a| self.is_object_schema(a)) {
                        return Err(format!("{path} must be an object, not an array"));
                    }
                    return Ok(());
                }
                let mut first = None;
                for alt in candidates {
                    match self.value(v, alt, path, depth + 1) {
                        Ok(()) => return Ok(()),
                        Err(e) => {
                            first.get_or_insert(e);
                        }
                    }
                }
                return first.map_or(Ok(()), Err);
            }
        }
        match v {
            Value::Array(items) if self.is_object_schema(s) => {
                let _ = items;
                Err(format!("{path} must be an object, not an array"))
            }
            Value::Array(items) => match s.get("items") {
                Some(item) if item.is_object() => {
                    for (i, x) in items.iter().enumerate() {
                        self.value(x, item, &format!("{path}[{i}]"), depth + 1)?;
                    }
                    Ok(())
                }
                _ => Ok(()),
            },
            Value::Object(fields) => {
                let props = s.get("properties").and_then(Value::as_object);
                let extra = s.get("additionalProperties").filter(|a| a.is_object());
                for (k, x) in fields {
                    if let Some(p) = props.and_then(|p| p.get(k)).or(extra) {
                        self.value(x, p, &format!("{path}.{k}"), depth + 1)?;
                    }
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// The schema's `type`, one name or a list.
fn types(s: &Value) -> Option<Vec<&str>> {
    match s.get("type")? {
        Value::String(t) => Some(vec![t.as_str()]),
        Value::Array(ts) => Some(ts.iter().filter_map(Value::as_str).collect()),
        _ => None,
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::PoolSpec;

    fn spec() -> Value {
        serde_json::json!({
            "name": "ci", "size": 1, "flintlock_hosts": ["h"],
            "replenishment": {"strategy": "REPLACE_ON_DELETE"},
            "microvm_template": {
                "kernel": {"image": "k", "filename": "boot/vmlinux"},
                "root_volume": {"id": "root", "source": {"container_source": "img"}},
                "additional_volumes": [{"id": "data", "source": {"container_source": "img"}}],
                "interfaces": [{"device_id": "eth1", "type": "TAP"}]
            }
        })
    }

    fn check_spec(v: &Value) -> Result<(), String> {
        check::<PoolSpec>(&serde_json::to_vec(v).unwrap())
    }

    #[test]
    fn a_documented_body_with_arrays_passes() {
        check_spec(&spec()).unwrap();
    }

    #[test]
    fn an_array_for_a_documented_object_is_named() {
        let mut v = spec();
        v["microvm_template"]["additional_volumes"][0]["source"] = serde_json::json!([null, null]);
        let e = check_spec(&v).unwrap_err();
        assert_eq!(e, "body.microvm_template.additional_volumes[0].source must be an object, not an array");

        let mut v = spec();
        v["replenishment"] = serde_json::json!(["REPLACE_ON_DELETE", null]);
        assert_eq!(check_spec(&v).unwrap_err(), "body.replenishment must be an object, not an array");

        let mut v = spec();
        v["microvm_template"]["root_volume"] = serde_json::json!(["root", false]);
        assert!(check_spec(&v).unwrap_err().starts_with("body.microvm_template.root_volume must be an object"));

        assert_eq!(check_spec(&serde_json::json!(["ci", 1])).unwrap_err(), "body must be an object, not an array");
    }
}
