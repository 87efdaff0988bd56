// Package pgtest gives tests a real PostgreSQL with isolated state: each
// test gets a schema of its own in the pgoutbox_test database, dropped when
// the test ends, so parallel packages and repeated runs never see each
// other's rows.
//
// Every schema a test binary creates starts with RunPrefix, unique to the
// process, so its TestMain can check, with CheckNoLeftoverSchemas, that none
// outlives the tests without confusing them with the schemas of packages
// running in parallel.
//
// The server comes from POSTGRES_DSN, or 127.0.0.1:5432 when unset. `make
// test` sets POSTGRES_DSN after finding or starting a server
// (scripts/postgres-env.sh).
package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Database is the database the tests create their schemas in.
const Database = "pgoutbox_test"

const defaultDSN = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// RunPrefix starts the name of every schema this process creates ("t_",
// six random hex digits, "_"): lower case, so SQL may name it unquoted, and
// unique per test binary, so the leftover check sees only its own schemas.
var RunPrefix = "t_" + randomHex(6) + "_"

var (
	dbOnce sync.Once
	dbDSN  string
	dbErr  error

	// createdSchemas says whether the leftover check has anything to look for.
	createdSchemas atomic.Bool
)

func randomHex(n int) string {
	return strings.ReplaceAll(uuid.NewString(), "-", "")[:n]
}

// AdminDSN is the server's DSN as configured (POSTGRES_DSN or the default).
func AdminDSN() string {
	if v := os.Getenv("POSTGRES_DSN"); v != "" {
		return v
	}
	return defaultDSN
}

// DSN returns the DSN of the test database, creating the database on first
// use. It fails the test, with what to do, when no server is reachable.
func DSN(t testing.TB) string {
	t.Helper()
	dbOnce.Do(func() { dbDSN, dbErr = ensureDatabase() })
	if dbErr != nil {
		t.Fatalf("PostgreSQL is not usable at %s: %v\n"+
			"Run the tests with `make test`, which finds or starts a server, or provide one:\n"+
			"  - set POSTGRES_DSN=postgres://user@host:port/db?sslmode=disable, or\n"+
			"  - start a local server on 127.0.0.1:5432 (Debian: pg_ctlcluster --skip-systemctl-redirect <version> main start), or\n"+
			"  - docker compose up -d --wait (docker-compose.yml)", redact(AdminDSN()), dbErr)
	}
	return dbDSN
}

func ensureDatabase() (string, error) {
	admin := AdminDSN()
	u, err := url.Parse(admin)
	if err != nil {
		return "", fmt.Errorf("POSTGRES_DSN is not a URL: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, admin)
	if err != nil {
		return "", err
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, Database).Scan(&exists); err != nil {
		return "", err
	}
	if !exists {
		_, err := conn.Exec(ctx, `CREATE DATABASE `+Database)
		var pgErr *pgconn.PgError
		// Another test package may have created it a moment ago.
		if err != nil && !(errors.As(err, &pgErr) && (pgErr.Code == "42P04" || pgErr.Code == "23505")) {
			return "", fmt.Errorf("create database %s: %w", Database, err)
		}
	}
	u.Path = "/" + Database
	return u.String(), nil
}

func redact(dsn string) string {
	if u, err := url.Parse(dsn); err == nil {
		return u.Redacted()
	}
	return dsn
}

// Env is one test's slice of the database.
type Env struct {
	DSN    string
	Schema string
	Pool   *pgxpool.Pool
}

// Options tune Setup.
type Options struct {
	MaxConns int32 // pool size; defaults to 10
}

// Setup creates a fresh schema and a pool for the test; both go away when
// the test ends.
func Setup(t testing.TB, opts ...Options) *Env {
	t.Helper()
	var o Options
	if len(opts) > 0 {
		o = opts[0]
	}
	if o.MaxConns == 0 {
		o.MaxConns = 10
	}
	dsn := DSN(t)
	schema := RunPrefix + randomHex(16)
	pool := NewPool(t, dsn, o.MaxConns)
	ctx := context.Background()
	createdSchemas.Store(true) // before CREATE: a timed-out CREATE may still have committed
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := pool.Exec(ctx, `DROP SCHEMA `+schema+` CASCADE`); err != nil {
			t.Logf("drop schema %s: %v", schema, err)
		}
	})
	return &Env{DSN: dsn, Schema: schema, Pool: pool}
}

// NewPool opens a pool that is closed when the test ends.
func NewPool(t testing.TB, dsn string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatalf("parse DSN: %v", err)
	}
	cfg.MaxConns = maxConns
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("open pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// CheckNoLeftoverSchemas runs the tests (m.Run) and then fails the run if a
// schema this process created, one named RunPrefix..., is still in the test
// database: a test forgot to drop what it made. Use it as the package's
// TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.CheckNoLeftoverSchemas(m)) }
//
// It returns m.Run's exit code, or 1 with the leftover schemas on stderr.
// Packages that made no schema are not checked, so they need no server.
func CheckNoLeftoverSchemas(m *testing.M) int {
	code := m.Run()
	if !createdSchemas.Load() {
		return code
	}
	dbOnce.Do(func() {}) // orders the read of dbDSN after Setup's write
	return CheckSchemasGone(code, dbDSN, RunPrefix, true)
}

// CheckSchemasGone returns code, or 1 when code is 0 and the database at dsn
// still holds schemas whose names start with prefix; it lists them on stderr.
// created says that this process certainly made such a schema: then being
// unable to look is a failure as well, otherwise only a note (nothing can
// have been left on a server the tests could not reach).
func CheckSchemasGone(code int, dsn, prefix string, created bool) int {
	left, err := SchemasWithPrefix(dsn, prefix)
	switch {
	case err != nil && created:
		fmt.Fprintf(os.Stderr, "FAIL: could not check that the tests dropped their schemas %s* in %s: %v\n", prefix, redact(dsn), err)
	case err != nil:
		fmt.Fprintf(os.Stderr, "pgtest: not checking for leftover schemas %s* in %s: %v\n", prefix, redact(dsn), err)
		return code
	case len(left) > 0:
		fmt.Fprintf(os.Stderr, "FAIL: %d schema(s) created by these tests remain in %s: %s\n"+
			"Every test must drop what it creates: pgtest.Setup drops its own schema; drop any other in a t.Cleanup (in an example, a defer).\n",
			len(left), redact(dsn), strings.Join(left, ", "))
	default:
		return code
	}
	if code == 0 {
		code = 1
	}
	return code
}

// SchemasWithPrefix lists the schemas of the database at dsn whose names
// start with prefix (compared literally: "_" is no wildcard here).
func SchemasWithPrefix(dsn, prefix string) ([]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, err
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT nspname FROM pg_namespace WHERE left(nspname, length($1)) = $1 ORDER BY 1`, prefix)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}
