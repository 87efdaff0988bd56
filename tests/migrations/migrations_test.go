// Package migrations_test applies pgoutbox's rendered migrations with goose
// and golang-migrate, as libraries, and checks that each tool reaches the
// layout schema.Create builds, goes down to nothing and up again; and it
// runs docs/from-watermill-sql.md's moves on tables watermill-sql filled.
// It is a module of its own so the library depends on none of these.
package migrations_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/golang-migrate/migrate/v4"
	migratepgx "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/catalogtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// The layouts compared: the version tables aside (catalogtest.DumpSQL).
var catalogDumpSQL = catalogtest.DumpSQL("schema_version", "goose_db_version", "schema_migrations")

type testBundle struct {
	ctx    context.Context
	target *pgoutboxtest.Schema // the tool migrates this one
	cfg    schema.Config        // the outbox in target
	db     *sql.DB              // on target, search_path = target (the tool's table lands there)
	want   []string             // the catalog schema.Create builds for cfg
}

func setup(t *testing.T, cfg schema.Config) *testBundle {
	t.Helper()
	ctx := context.Background()
	b := &testBundle{ctx: ctx, target: pgoutboxtest.NewSchema(t, pgoutboxtest.Options{})}
	cfg.Schema = b.target.Name
	b.cfg = cfg

	created := pgoutboxtest.NewSchema(t, pgoutboxtest.Options{})
	ccfg := cfg
	ccfg.Schema = created.Name
	require.NoError(t, schema.Create(ctx, tx.FromPgxPool(created.Pool), ccfg))
	b.want = b.catalog(t, created.Name)
	require.Greater(t, len(b.want), 20)

	b.db = stdlib.OpenDB(*b.connConfig(t))
	t.Cleanup(func() { _ = b.db.Close() })
	return b
}

// connConfig connects to the target with its schema first on the
// search_path (the tool's table lands there).
func (b *testBundle) connConfig(t *testing.T) *pgx.ConnConfig {
	t.Helper()
	conf, err := pgx.ParseConfig(b.target.DSN)
	require.NoError(t, err)
	conf.RuntimeParams["search_path"] = b.target.Name
	return conf
}

func (b *testBundle) catalog(t *testing.T, schemaName string) []string {
	t.Helper()
	rows, err := b.target.Pool.Query(b.ctx, catalogDumpSQL, schemaName)
	require.NoError(t, err)
	defer rows.Close()
	var out []string
	for rows.Next() {
		var l string
		require.NoError(t, rows.Scan(&l))
		out = append(out, l)
	}
	require.NoError(t, rows.Err())
	return out
}

// requireHead checks the target against Create's layout, by Validate and
// by the whole catalog.
func (b *testBundle) requireHead(t *testing.T) {
	t.Helper()
	require.NoError(t, schema.Validate(b.ctx, tx.FromPgxPool(b.target.Pool), b.cfg))
	require.Equal(t, b.want, b.catalog(t, b.target.Name))
}

var configs = map[string]schema.Config{
	"Default":                    {},
	"OwnNamesWithoutDeadLetters": {Table: "events", NoDeadLetterTable: true},
	"OwnDeadLetterTable":         {Table: "jobs", DeadLetterTable: "jobs_failed"},
}

func TestGoose(t *testing.T) {
	t.Parallel()
	for name, cfg := range configs {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, cfg)
			fsys, err := schema.Migrations(b.cfg, schema.FormatGoose)
			require.NoError(t, err)
			p, err := goose.NewProvider(goose.DialectPostgres, b.db, fsys)
			require.NoError(t, err)
			require.Len(t, p.ListSources(), schema.LatestVersion())

			res, err := p.Up(b.ctx)
			require.NoError(t, err)
			require.Len(t, res, schema.LatestVersion())
			b.requireHead(t)

			_, err = p.DownTo(b.ctx, 0)
			require.NoError(t, err)
			require.Empty(t, b.catalog(t, b.target.Name), "down to 0 leaves only goose's table")

			_, err = p.Up(b.ctx)
			require.NoError(t, err)
			b.requireHead(t)
			v, err := p.GetDBVersion(b.ctx)
			require.NoError(t, err)
			require.Equal(t, int64(schema.LatestVersion()), v)
		})
	}
}

func TestGolangMigrate(t *testing.T) {
	t.Parallel()
	for name, cfg := range configs {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, cfg)
			fsys, err := schema.Migrations(b.cfg, schema.FormatGolangMigrate)
			require.NoError(t, err)
			src, err := iofs.New(fsys, ".")
			require.NoError(t, err)
			driver, err := migratepgx.WithInstance(b.db, &migratepgx.Config{})
			require.NoError(t, err)
			m, err := migrate.NewWithInstance("iofs", src, "pgx5", driver)
			require.NoError(t, err)
			t.Cleanup(func() { _, _ = m.Close() })

			require.NoError(t, m.Up())
			b.requireHead(t)
			v, dirty, err := m.Version()
			require.NoError(t, err)
			require.False(t, dirty)
			require.Equal(t, uint(schema.LatestVersion()), v)

			require.NoError(t, m.Steps(-1))
			require.NoError(t, m.Up(), "the last version again")
			b.requireHead(t)

			require.NoError(t, m.Down())
			require.Empty(t, b.catalog(t, b.target.Name), "down to nothing leaves only golang-migrate's table")
			require.NoError(t, m.Up())
			b.requireHead(t)
			require.True(t, errors.Is(m.Up(), migrate.ErrNoChange))
		})
	}
}

// Deploys that start several processes at once each run the migrations:
// without a locker goose lets two of them apply one version together (a
// duplicate type or schema, or the version recorded twice). With goose's
// session locker they take turns, and the later ones find nothing to do.
func TestGooseFromSeveralProcessesAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, schema.Config{})
	const processes = 3
	errs := make(chan error, processes)
	for range processes {
		db := stdlib.OpenDB(*b.connConfig(t)) // a process of its own: its own connections
		t.Cleanup(func() { _ = db.Close() })
		go func() { errs <- gooseUp(b.ctx, db, b.cfg) }()
	}
	for range processes {
		require.NoError(t, <-errs)
	}
	b.requireHead(t)
	var rows, versions int
	require.NoError(t, b.db.QueryRowContext(b.ctx, `SELECT count(*), count(DISTINCT version_id) FROM goose_db_version WHERE version_id > 0`).Scan(&rows, &versions))
	require.Equal(t, schema.LatestVersion(), versions)
	require.Equal(t, schema.LatestVersion(), rows, "each version recorded once")
}

// gooseUp migrates the outbox as each process of a deploy does, with
// goose's session locker: one at a time.
func gooseUp(ctx context.Context, db *sql.DB, cfg schema.Config) error {
	fsys, err := schema.Migrations(cfg, schema.FormatGoose)
	if err != nil {
		return err
	}
	locker, err := lock.NewPostgresSessionLocker()
	if err != nil {
		return err
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, fsys, goose.WithSessionLocker(locker))
	if err != nil {
		return err
	}
	_, err = p.Up(ctx)
	return err
}

// TestUpgradeFromFirstRelease migrates an outbox at version 1 that holds
// messages to the latest with goose, and the rows survive.
func TestUpgradeFromFirstRelease(t *testing.T) {
	t.Parallel()
	b := setup(t, schema.Config{})
	fsys, err := schema.Migrations(b.cfg, schema.FormatGoose)
	require.NoError(t, err)
	p, err := goose.NewProvider(goose.DialectPostgres, b.db, fsys)
	require.NoError(t, err)
	_, err = p.UpTo(b.ctx, 1)
	require.NoError(t, err)
	_, err = b.target.Pool.Exec(b.ctx, `INSERT INTO "`+b.target.Name+`".outbox (topic, uuid, payload) VALUES ('orders', 'u1', 'x')`)
	require.NoError(t, err)
	_, err = p.Up(b.ctx)
	require.NoError(t, err)
	b.requireHead(t)
	var n int
	require.NoError(t, b.target.Pool.QueryRow(b.ctx, `SELECT count(*) FROM "`+b.target.Name+`".outbox WHERE consumer_group = ''`).Scan(&n))
	require.Equal(t, 1, n)
}

// TestBaselineACreatedOutbox follows docs/upgrading.md for an outbox that
// schema.Create made: each tool is told the latest version is applied
// (golang-migrate: force; goose: rows in its table), then has nothing to
// do, and can go down.
func TestBaselineACreatedOutbox(t *testing.T) {
	t.Parallel()
	latest := schema.LatestVersion()

	t.Run("GolangMigrateForce", func(t *testing.T) {
		t.Parallel()
		b := setup(t, schema.Config{})
		require.NoError(t, schema.Create(b.ctx, tx.FromPgxPool(b.target.Pool), b.cfg))
		fsys, err := schema.Migrations(b.cfg, schema.FormatGolangMigrate)
		require.NoError(t, err)
		src, err := iofs.New(fsys, ".")
		require.NoError(t, err)
		driver, err := migratepgx.WithInstance(b.db, &migratepgx.Config{})
		require.NoError(t, err)
		m, err := migrate.NewWithInstance("iofs", src, "pgx5", driver)
		require.NoError(t, err)
		t.Cleanup(func() { _, _ = m.Close() })
		require.NoError(t, m.Force(latest))
		require.ErrorIs(t, m.Up(), migrate.ErrNoChange)
		require.NoError(t, m.Steps(-1))
		require.NoError(t, m.Up())
		b.requireHead(t)
	})

	t.Run("GooseVersionRows", func(t *testing.T) {
		t.Parallel()
		b := setup(t, schema.Config{})
		require.NoError(t, schema.Create(b.ctx, tx.FromPgxPool(b.target.Pool), b.cfg))
		fsys, err := schema.Migrations(b.cfg, schema.FormatGoose)
		require.NoError(t, err)
		p, err := goose.NewProvider(goose.DialectPostgres, b.db, fsys)
		require.NoError(t, err)
		_, err = p.GetDBVersion(b.ctx) // creates goose's table
		require.NoError(t, err)
		_, err = b.db.ExecContext(b.ctx, `INSERT INTO goose_db_version (version_id, is_applied) SELECT v, true FROM generate_series(1, $1) v`, latest)
		require.NoError(t, err)
		res, err := p.Up(b.ctx)
		require.NoError(t, err)
		require.Empty(t, res)
		_, err = p.Down(b.ctx)
		require.NoError(t, err)
		_, err = p.Up(b.ctx)
		require.NoError(t, err)
		b.requireHead(t)
	})
}

// firstReleaseOutbox makes an outbox as the first release left it: version
// 1's layout without the dead-letter table (it made none by default), no
// version recorded, and a message.
func firstReleaseOutbox(t *testing.T) *testBundle {
	t.Helper()
	b := setup(t, schema.Config{})
	noDLQ := b.cfg
	noDLQ.NoDeadLetterTable = true
	_, err := schema.Migrate(b.ctx, tx.FromPgxPool(b.target.Pool), noDLQ, 1)
	require.NoError(t, err)
	_, err = b.target.Pool.Exec(b.ctx, `DROP TABLE "`+b.target.Name+`".outbox_schema_version`)
	require.NoError(t, err)
	_, err = b.target.Pool.Exec(b.ctx, `INSERT INTO "`+b.target.Name+`".outbox (topic, uuid, payload) VALUES ('orders', 'u1', 'x')`)
	require.NoError(t, err)
	return b
}

// toolVersion is what docs/upgrading.md has goose and golang-migrate users
// learn first ("pgoutbox schema migrate baseline --dry-run"): the version
// to mark applied in the tool's table. It records nothing in pgoutbox's.
func (b *testBundle) toolVersion(t *testing.T) int {
	t.Helper()
	l, err := schema.BaselinePlan(b.ctx, tx.FromPgxPool(b.target.Pool), b.cfg)
	require.NoError(t, err)
	return l.ToolVersion()
}

// requireUpgraded checks the end of an upgrade from the first release:
// Create's layout, the message kept for the default group, and no version
// recorded in pgoutbox's own table (the tool keeps the version).
func (b *testBundle) requireUpgraded(t *testing.T) {
	t.Helper()
	b.requireHead(t)
	var n int
	require.NoError(t, b.target.Pool.QueryRow(b.ctx, `SELECT count(*) FROM "`+b.target.Name+`".outbox WHERE consumer_group = ''`).Scan(&n))
	require.Equal(t, 1, n)
	st, err := schema.MigrationStatus(b.ctx, tx.FromPgxPool(b.target.Pool), b.cfg)
	require.NoError(t, err)
	require.Zero(t, st.Current, "pgoutbox's version table is not written")
}

// TestFirstReleaseWithoutDeadLetterTable follows docs/upgrading.md ("An
// outbox made before versions were recorded") with goose and
// golang-migrate on an outbox of the first release, which has no
// dead-letter table: marking version 1 applied would make version 3 alter
// a table that does not exist; the documented N runs version 1 again,
// which creates it. It also follows the docs' way back from that failure.
func TestFirstReleaseWithoutDeadLetterTable(t *testing.T) {
	t.Parallel()

	gooseProvider := func(t *testing.T, b *testBundle) *goose.Provider {
		t.Helper()
		fsys, err := schema.Migrations(b.cfg, schema.FormatGoose)
		require.NoError(t, err)
		p, err := goose.NewProvider(goose.DialectPostgres, b.db, fsys)
		require.NoError(t, err)
		_, err = p.GetDBVersion(b.ctx) // creates goose's table
		require.NoError(t, err)
		return p
	}
	golangMigrate := func(t *testing.T, b *testBundle) *migrate.Migrate {
		t.Helper()
		fsys, err := schema.Migrations(b.cfg, schema.FormatGolangMigrate)
		require.NoError(t, err)
		src, err := iofs.New(fsys, ".")
		require.NoError(t, err)
		driver, err := migratepgx.WithInstance(b.db, &migratepgx.Config{})
		require.NoError(t, err)
		m, err := migrate.NewWithInstance("iofs", src, "pgx5", driver)
		require.NoError(t, err)
		t.Cleanup(func() { _, _ = m.Close() })
		return m
	}

	t.Run("Goose", func(t *testing.T) {
		t.Parallel()
		b := firstReleaseOutbox(t)
		p := gooseProvider(t, b)
		_, err := b.db.ExecContext(b.ctx, `INSERT INTO goose_db_version (version_id, is_applied) SELECT v, true FROM generate_series(1, $1) v`, b.toolVersion(t))
		require.NoError(t, err)
		_, err = p.Up(b.ctx)
		require.NoError(t, err)
		b.requireUpgraded(t)
	})

	t.Run("GolangMigrate", func(t *testing.T) {
		t.Parallel()
		b := firstReleaseOutbox(t)
		m := golangMigrate(t, b)
		if n := b.toolVersion(t); n > 0 {
			require.NoError(t, m.Force(n))
		}
		require.NoError(t, m.Up())
		b.requireUpgraded(t)
	})

	// Version 1 marked applied, as the docs said before: up stops at
	// version 3 (goose at 2; golang-migrate dirty at 3), having rolled it
	// back. The docs' way on: forget the versions, and up again.
	t.Run("GooseAfterVersion3Failed", func(t *testing.T) {
		t.Parallel()
		b := firstReleaseOutbox(t)
		p := gooseProvider(t, b)
		_, err := b.db.ExecContext(b.ctx, `INSERT INTO goose_db_version (version_id, is_applied) VALUES (1, true)`)
		require.NoError(t, err)
		_, err = p.Up(b.ctx)
		require.ErrorContains(t, err, "does not exist")
		_, err = b.db.ExecContext(b.ctx, `DELETE FROM goose_db_version WHERE version_id > 0`)
		require.NoError(t, err)
		_, err = p.Up(b.ctx)
		require.NoError(t, err)
		b.requireUpgraded(t)
	})

	t.Run("GolangMigrateAfterVersion3Failed", func(t *testing.T) {
		t.Parallel()
		b := firstReleaseOutbox(t)
		m := golangMigrate(t, b)
		require.NoError(t, m.Force(1))
		require.ErrorContains(t, m.Up(), "does not exist")
		_, dirty, err := m.Version()
		require.NoError(t, err)
		require.True(t, dirty)
		require.NoError(t, m.Force(-1)) // migrate force -1: no version applied
		require.NoError(t, m.Up())
		b.requireUpgraded(t)
	})
}
