package pgoutboxtest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Database is the database PubSub and NewSchema create their schemas in
// when the server DSN (see ServerDSN) names none, or names one of the
// server's own databases (postgres, template0, template1), which tests
// should not fill. It is created on first use. A DSN naming any other
// database, such as POSTGRES_DSN=postgres://localhost/myapp_test, is used
// as it is: that database must exist. Options.DSN overrides both.
const Database = "pgoutbox_test"

// LocalDSN is the server tried when POSTGRES_DSN is unset: 127.0.0.1:5432,
// user postgres, trust authentication.
const LocalDSN = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// Ephemeral cluster started from a local installation: the same directory
// and port as scripts/postgres-env.sh, so `make test` and `go test` share it.
const ephemeralPort = "54329"

// StartServer, when set, is the last way tried to get a server: it starts
// one (for example a container with github.com/ory/dockertest/v3) and
// returns its DSN. It runs at most once per process, when neither
// POSTGRES_DSN, nor 127.0.0.1:5432, nor a locally installed PostgreSQL
// works. Set it in TestMain, before the tests run; stopping the server is
// up to you (after m.Run). Defaults to nil: pgoutboxtest does not depend
// on a container library; the module
// github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest/dockerpg
// sets it to start PostgreSQL in Docker (dockerpg.Main).
var StartServer func(ctx context.Context) (dsn string, err error)

var (
	serverOnce sync.Once
	serverDSN  string
	serverErr  error
)

// ServerDSN returns the DSN of a PostgreSQL server for tests, found once per
// process in this order:
//
//  1. POSTGRES_DSN, if set;
//  2. a server accepting connections at LocalDSN;
//  3. a locally installed PostgreSQL (initdb and pg_ctl on PATH or under
//     /usr/lib/postgresql/*/bin): an ephemeral cluster in
//     $TMPDIR/pgoutbox-postgres on port 54329, created and started on first
//     use and left running for later runs (as scripts/postgres-env.sh does);
//  4. StartServer, if set (e.g. Docker through dockertest).
//
// PGOUTBOX_PG_WAYS limits the ways tried (default "dsn local initdb
// docker"). The error lists every way and why it failed.
func ServerDSN() (string, error) {
	serverOnce.Do(func() {
		ways := os.Getenv("PGOUTBOX_PG_WAYS")
		if ways == "" {
			ways = "dsn local initdb docker"
		}
		serverDSN, serverErr = discover(strings.Fields(ways), os.Getenv("POSTGRES_DSN"))
	})
	return serverDSN, serverErr
}

// noServerHelp ends the error of a failed discovery.
const noServerHelp = `Provide a PostgreSQL server for the tests in one of these ways:
  1. POSTGRES_DSN=postgres://user:password@host:port/database?sslmode=disable
  2. a server on 127.0.0.1:5432 with trust authentication for user postgres
     (Debian: apt-get install postgresql, then pg_ctlcluster --skip-systemctl-redirect <version> main start)
  3. a local installation (initdb and pg_ctl on PATH): pgoutboxtest starts an ephemeral cluster on port 54329
  4. Docker: set pgoutboxtest.StartServer in TestMain (e.g. with github.com/ory/dockertest/v3),
     or docker compose up -d --wait with the repository's docker-compose.yml
Or set Options.SkipIfNoDatabase to skip, instead of fail, the tests that need one.`

func discover(ways []string, envDSN string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var tried []string
	for _, way := range ways {
		var dsn string
		var err error
		switch way {
		case "dsn":
			if envDSN == "" {
				tried = append(tried, "POSTGRES_DSN: not set")
				continue
			}
			dsn, err = envDSN, ping(ctx, envDSN)
			if err != nil {
				// An explicit DSN is what the user asked for: do not
				// quietly test against another server.
				return "", fmt.Errorf("pgoutboxtest: POSTGRES_DSN=%s: %w\n%s", redact(envDSN), err, noServerHelp)
			}
		case "local":
			dsn, err = LocalDSN, ping(ctx, LocalDSN)
		case "initdb":
			dsn, err = startEphemeral(ctx)
		case "docker":
			if StartServer == nil {
				err = errors.New("pgoutboxtest.StartServer is not set")
			} else if dsn, err = StartServer(ctx); err == nil {
				err = ping(ctx, dsn)
			}
		default:
			err = errors.New("unknown way (PGOUTBOX_PG_WAYS takes dsn, local, initdb, docker)")
		}
		if err == nil {
			return dsn, nil
		}
		tried = append(tried, fmt.Sprintf("%s: %v", way, err))
	}
	return "", fmt.Errorf("pgoutboxtest: no PostgreSQL server found (tried: %s)\n%s", strings.Join(tried, "; "), noServerHelp)
}

func ping(ctx context.Context, dsn string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	return conn.Ping(ctx)
}

// startEphemeral starts (creating it when needed) a cluster from the local
// installation's binaries.
func startEphemeral(ctx context.Context) (string, error) {
	bindir := ""
	if p, err := exec.LookPath("initdb"); err == nil {
		bindir = filepath.Dir(p)
	} else if dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin"); len(dirs) > 0 {
		sort.Strings(dirs) // newest major last (single digits are long gone)
		bindir = dirs[len(dirs)-1]
	}
	if bindir == "" {
		return "", errors.New("no initdb on PATH or under /usr/lib/postgresql/*/bin")
	}
	dsn := "postgres://postgres@127.0.0.1:" + ephemeralPort + "/postgres?sslmode=disable"
	if ping(ctx, dsn) == nil {
		return dsn, nil
	}
	dir := filepath.Join(os.TempDir(), "pgoutbox-postgres")
	asOwner := func(name string, args ...string) *exec.Cmd {
		if os.Geteuid() == 0 { // PostgreSQL refuses to run as root
			return exec.CommandContext(ctx, "runuser", append([]string{"-u", "postgres", "--", name}, args...)...)
		}
		return exec.CommandContext(ctx, name, args...)
	}
	if _, err := os.Stat(filepath.Join(dir, "PG_VERSION")); err != nil {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return "", err
		}
		if os.Geteuid() == 0 {
			if out, err := exec.CommandContext(ctx, "chown", "postgres", dir).CombinedOutput(); err != nil {
				return "", fmt.Errorf("chown %s: %v: %s", dir, err, out)
			}
		}
		if out, err := asOwner(filepath.Join(bindir, "initdb"), "-D", dir, "-U", "postgres", "--auth=trust").CombinedOutput(); err != nil {
			return "", fmt.Errorf("initdb in %s: %v: %s", dir, err, lastLine(out))
		}
	}
	out, err := asOwner(filepath.Join(bindir, "pg_ctl"), "-D", dir, "-l", filepath.Join(dir, "server.log"), "-w",
		"-o", "-p "+ephemeralPort+" -k "+dir+" -c listen_addresses=127.0.0.1 -c max_connections=200", "start").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("pg_ctl start in %s: %v: %s (see %s)", dir, err, lastLine(out), filepath.Join(dir, "server.log"))
	}
	return dsn, ping(ctx, dsn)
}

func lastLine(out []byte) string {
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1]
}

var (
	dbMu   sync.Mutex
	dbDSNs = map[string]string{} // server DSN -> test database DSN
)

// serverDatabases are the databases every server has: a DSN naming one of
// them names a server, not a database for tests.
var serverDatabases = map[string]bool{"postgres": true, "template0": true, "template1": true}

// namedDatabase returns the database a DSN (URL or keyword/value form)
// names itself, or "" when it names none.
func namedDatabase(dsn string) string {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return ""
		}
		return strings.TrimPrefix(u.Path, "/")
	}
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil || !strings.Contains(dsn, "dbname") {
		return "" // the database pgconn found came from the environment or the user name
	}
	return cfg.Database
}

// withDatabase returns dsn with its database replaced by db.
func withDatabase(dsn, db string) (string, error) {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return "", fmt.Errorf("pgoutboxtest: the server DSN is not a valid URL: %w", err)
		}
		u.Path = "/" + db
		return u.String(), nil
	}
	return dsn + " dbname=" + db, nil // the last value of a keyword wins
}

// testDatabaseDSN returns the DSN of the database for tests on the server
// of serverDSN: the database it names, or Database, created on first use
// (see Database).
func testDatabaseDSN(serverDSN string) (string, error) {
	if db := namedDatabase(serverDSN); db != "" && !serverDatabases[db] {
		return serverDSN, nil
	}
	dbMu.Lock()
	defer dbMu.Unlock()
	if dsn, ok := dbDSNs[serverDSN]; ok {
		return dsn, nil
	}
	dsn, err := withDatabase(serverDSN, Database)
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, serverDSN)
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
		// Another test process may have created it a moment ago.
		if err != nil && !(errors.As(err, &pgErr) && (pgErr.Code == "42P04" || pgErr.Code == "23505")) {
			return "", fmt.Errorf("pgoutboxtest: create database %s: %w", Database, err)
		}
	}
	dbDSNs[serverDSN] = dsn
	return dsn, nil
}

// DSN returns the DSN of the test database on the server ServerDSN finds:
// the database that DSN names, else Database, created on first use (see
// Database). When no server is
// found it fails the test with the ways to provide one, or skips it when
// skip is true.
func DSN(t testing.TB, skip bool) string {
	t.Helper()
	server, err := ServerDSN()
	if err == nil {
		var dsn string
		if dsn, err = testDatabaseDSN(server); err == nil {
			return dsn
		}
		err = fmt.Errorf("pgoutboxtest: PostgreSQL at %s is not usable: %w", redact(server), err)
	}
	if skip {
		t.Skipf("%v", err)
	}
	t.Fatalf("%v", err)
	return ""
}

func redact(dsn string) string {
	if u, err := url.Parse(dsn); err == nil {
		return u.Redacted()
	}
	return dsn
}
