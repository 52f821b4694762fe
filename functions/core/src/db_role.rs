//! The runtime database login (issue 25 item 9): the functions connect as a role with DML on
//! poolmgr's tables and nothing else (no DDL, not an owner of anything), and the master login
//! is kept for `migrate`, which creates that role and grants it after every migration.
//!
//! Which login: `POOLMGR_RUNTIME_DATABASE_USER` and `POOLMGR_RUNTIME_DATABASE_PASSWORD`, or on
//! AWS the secret `POOLMGR_RUNTIME_DATABASE_SECRET_ARN` names (`{"username", "password"}`, see
//! [`crate::secrets`]). Without them `migrate` only migrates, and the functions use whatever
//! `DATABASE_URL` says (a local run with one login).
//!
//! The password never travels in a statement: the role gets the SCRAM-SHA-256 verifier,
//! computed here, so neither `log_statement` nor `pg_stat_statements` can show it.

use tokio_postgres::Client;

pub const USER: &str = "POOLMGR_RUNTIME_DATABASE_USER";
pub const PASSWORD: &str = "POOLMGR_RUNTIME_DATABASE_PASSWORD";

/// What the runtime role may do on every table and sequence in `public`. No TRUNCATE,
/// REFERENCES or TRIGGER: the functions use none of them.
const TABLE_PRIVILEGES: &str = "SELECT, INSERT, UPDATE, DELETE";
const SEQUENCE_PRIVILEGES: &str = "USAGE, SELECT, UPDATE";

/// The runtime login from a configuration lookup: `None` when neither variable is set.
pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<(String, String)>, String> {
    let user = lookup(USER).filter(|s| !s.trim().is_empty());
    let password = lookup(PASSWORD).filter(|s| !s.is_empty());
    match (user, password) {
        (None, None) => Ok(None),
        (Some(u), Some(p)) => {
            check_name(u.trim())?;
            if p.len() < 16 {
                return Err(format!("{PASSWORD} is shorter than 16 characters: use a generated password"));
            }
            Ok(Some((u.trim().to_owned(), p)))
        }
        (Some(_), None) => Err(format!("{USER} is set but {PASSWORD} is not: set both, or neither")),
        (None, Some(_)) => Err(format!("{PASSWORD} is set but {USER} is not: set both, or neither")),
    }
}

/// A role name we put in statements unquoted-safe: lower-case letters, digits and `_`.
fn check_name(user: &str) -> Result<(), String> {
    let ok = !user.is_empty()
        && user.len() <= 63
        && user.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && user.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !user.starts_with("pg_");
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{USER}={user:?} is not a role name poolmgr accepts: 1-63 lower-case letters, digits and _, \
             starting with a letter or _ and not with pg_"
        ))
    }
}

/// Creates or updates `user` as a plain login role (password `password`) and grants it DML on
/// every table and sequence of `public`, now and for tables the migrating login creates later.
/// Run by the migrating (owning) login after the migrations. Safe to run concurrently and
/// again: a lost race on the role is retried.
pub async fn ensure(client: &mut Client, user: &str, password: &str) -> Result<(), String> {
    check_name(user)?;
    let me: String = client
        .query_one("SELECT current_user::text", &[])
        .await
        .map_err(|e| format!("cannot read the migrating login: {e}"))?
        .get(0);
    if me == user {
        return Err(format!(
            "the runtime login {user} is the login migrate runs as: give the functions a role of their own \
             ({USER}), and keep this one for migrations"
        ));
    }
    // An existing role with powers is refused before anything about it changes. A role
    // created here has none (CREATE ROLE's defaults).
    let powers = client
        .query_opt(
            "SELECT rolsuper OR rolcreatedb OR rolcreaterole OR rolbypassrls FROM pg_roles WHERE rolname = $1",
            &[&user],
        )
        .await
        .map_err(|e| format!("cannot read role {user}: {e}"))?;
    if powers.is_some_and(|r| r.get::<_, bool>(0)) {
        return Err(format!(
            "role {user} has SUPERUSER, CREATEDB, CREATEROLE or BYPASSRLS: the runtime login must be a plain \
             login role; run ALTER ROLE {user} NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS as an administrator"
        ));
    }
    let verifier = postgres_protocol::password::scram_sha_256(password.as_bytes());
    // Only base64, digits, `$`, `:` and `=`: safe between single quotes.
    debug_assert!(!verifier.contains('\''));
    let mut attempt = 0;
    loop {
        attempt += 1;
        match grant(client, user, &verifier).await {
            Ok(()) => break,
            // Two migrations at once: one created the role (42710 duplicate_object, or 23505
            // on the catalog) or updated it meanwhile (XX000 tuple concurrently updated).
            Err(e) if attempt < 8 && retryable(&e) => {
                tracing::info!(user, attempt, error = %e, "runtime role changed concurrently, retrying");
                tokio::time::sleep(std::time::Duration::from_millis(50 * attempt)).await;
            }
            Err(e) => return Err(format!("cannot set up the runtime login {user}: {e}")),
        }
    }
    // Before PostgreSQL 15 every role may create in `public`; poolmgr's database is its own,
    // so take that away where the migrating login owns the schema (it does on RDS and on a
    // database it created). Elsewhere say what is left.
    if let Err(e) = client.batch_execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC").await {
        tracing::warn!(error = %e, "cannot revoke CREATE on schema public from PUBLIC: check that the runtime login cannot create tables");
    }
    Ok(())
}

async fn grant(client: &mut Client, user: &str, verifier: &str) -> Result<(), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let exists = tx.query_opt("SELECT 1 FROM pg_roles WHERE rolname = $1", &[&user]).await?.is_some();
    if exists {
        tx.batch_execute(&format!("ALTER ROLE {user} WITH LOGIN PASSWORD '{verifier}'")).await?;
    } else {
        tx.batch_execute(&format!("CREATE ROLE {user} WITH LOGIN PASSWORD '{verifier}'")).await?;
    }
    let db: String = tx.query_one("SELECT current_database()::text", &[]).await?.get(0);
    let db = db.replace('"', "\"\"");
    tx.batch_execute(&format!(
        "GRANT CONNECT ON DATABASE \"{db}\" TO {user};
         GRANT USAGE ON SCHEMA public TO {user};
         REVOKE CREATE ON SCHEMA public FROM {user};
         GRANT {TABLE_PRIVILEGES} ON ALL TABLES IN SCHEMA public TO {user};
         GRANT {SEQUENCE_PRIVILEGES} ON ALL SEQUENCES IN SCHEMA public TO {user};
         REVOKE INSERT, UPDATE, DELETE ON refinery_schema_history FROM {user};
         ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT {TABLE_PRIVILEGES} ON TABLES TO {user};
         ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT {SEQUENCE_PRIVILEGES} ON SEQUENCES TO {user};"
    ))
    .await?;
    tx.commit().await
}

fn retryable(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.code().is_some_and(|c| {
        *c == SqlState::DUPLICATE_OBJECT
            || *c == SqlState::UNIQUE_VIOLATION
            || *c == SqlState::INTERNAL_ERROR
            || *c == SqlState::T_R_SERIALIZATION_FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(key, _)| *key == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn both_or_neither_and_a_safe_name() {
        assert_eq!(from_lookup(lookup(&[])).unwrap(), None);
        let ok = from_lookup(lookup(&[(USER, "poolmgr_app"), (PASSWORD, "0123456789abcdefg")])).unwrap();
        assert_eq!(ok, Some(("poolmgr_app".into(), "0123456789abcdefg".into())));
        for bad in [
            vec![(USER, "poolmgr_app")],
            vec![(PASSWORD, "0123456789abcdefg")],
            vec![(USER, "poolmgr_app"), (PASSWORD, "short")],
            vec![(USER, "App"), (PASSWORD, "0123456789abcdefg")],
            vec![(USER, "x; DROP TABLE pools"), (PASSWORD, "0123456789abcdefg")],
            vec![(USER, "pg_monitor"), (PASSWORD, "0123456789abcdefg")],
            vec![(USER, "1app"), (PASSWORD, "0123456789abcdefg")],
        ] {
            let err = from_lookup(lookup(&bad)).unwrap_err();
            assert!(err.contains("POOLMGR_RUNTIME_DATABASE"), "{bad:?}: {err}");
            assert!(!err.contains("0123456789abcdefg"), "the error repeats the password: {err}");
        }
    }
}
