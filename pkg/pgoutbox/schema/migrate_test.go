package schema_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/catalogtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
)

// The layouts compared: the version tables aside (catalogtest.DumpSQL).
var catalogDumpSQL = catalogtest.DumpSQL("schema_version")

func (b *testBundle) catalog(t *testing.T, schemaName string) []string {
	t.Helper()
	rows, err := b.env.Pool.Query(context.Background(), catalogDumpSQL, schemaName)
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

func versions(steps []schema.MigrationStep) []int {
	var out []int
	for _, s := range steps {
		v := s.Version
		if s.Down {
			v = -v
		}
		out = append(out, v)
	}
	return out
}

func TestMigrationFiles(t *testing.T) {
	t.Parallel()
	latest := schema.LatestVersion()
	require.GreaterOrEqual(t, latest, 4)

	for _, cfg := range []schema.Config{{}, {Schema: "app", Table: "events", NoDeadLetterTable: true}} {
		ms, err := schema.MigrationList(cfg)
		require.NoError(t, err)
		require.Len(t, ms, latest)
		for i, m := range ms {
			require.Equal(t, i+1, m.Version)
			require.NotEmpty(t, m.Up, "version %d", m.Version)
			require.NotEmpty(t, m.Down, "version %d", m.Version)
			for _, s := range slices.Concat(m.Up, m.Down) {
				require.False(t, strings.HasSuffix(s, ";"), "statements come without their semicolon: %q", s)
				require.NotContains(t, s, "{{")
				if cfg.NoDeadLetterTable {
					require.NotContains(t, s, "_dlq")
				}
			}
		}
	}

	goose, err := schema.Migrations(schema.Config{}, schema.FormatGoose)
	require.NoError(t, err)
	names, err := fs.Glob(goose, "*")
	require.NoError(t, err)
	require.Equal(t, []string{"0001_initial.sql", "0002_lease_holder_parking.sql", "0003_consumer_groups.sql", "0004_ordering_keys.sql"}, names[:4])
	text, err := fs.ReadFile(goose, "0003_consumer_groups.sql")
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(string(text), "-- +goose Up\n-- +goose StatementBegin\n"), "%s", text)
	require.Contains(t, string(text), "\n-- +goose Down\n")
	require.Equal(t, strings.Count(string(text), "StatementBegin"), strings.Count(string(text), "StatementEnd"))

	gm, err := schema.Migrations(schema.Config{}, schema.FormatGolangMigrate)
	require.NoError(t, err)
	names, err = fs.Glob(gm, "0001_*")
	require.NoError(t, err)
	require.Equal(t, []string{"0001_initial.down.sql", "0001_initial.up.sql"}, names)
	require.NoError(t, fsTest(gm))

	_, err = schema.Migrations(schema.Config{Table: "bad name"}, schema.FormatGoose)
	require.ErrorIs(t, err, schema.ErrInvalidName)
	_, err = schema.ParseMigrationFormat("flyway")
	require.ErrorContains(t, err, "use goose or golang-migrate")
}

// fsTest checks the fs.FS contract the tools rely on: ReadDir of ".",
// Open and read of each file.
func fsTest(fsys fs.FS) error {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return err
	}
	for _, e := range entries {
		data, err := fs.ReadFile(fsys, e.Name())
		if err != nil {
			return err
		}
		info, err := e.Info()
		if err != nil {
			return err
		}
		if info.Size() != int64(len(data)) || e.IsDir() {
			return errors.New("bad file info for " + e.Name())
		}
	}
	if _, err := fsys.Open("missing.sql"); !errors.Is(err, fs.ErrNotExist) {
		return errors.New("want ErrNotExist")
	}
	return nil
}

func TestMigrate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("HeadMatchesCreateAndRoundTrips", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name}
		steps, err := schema.Migrate(ctx, b.exec, cfg, schema.Latest)
		require.NoError(t, err)
		require.Equal(t, []int{1, 2, 3, 4}, versions(steps)[:4])
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))

		created := b.freshSchema(t, "created")
		require.NoError(t, schema.Create(ctx, b.exec, schema.Config{Schema: created}))
		want := b.catalog(t, created)
		require.Greater(t, len(want), 40, "columns, relations, indexes and constraints of three tables")
		require.Equal(t, want, b.catalog(t, b.env.Name))

		_, err = schema.Migrate(ctx, b.exec, cfg, 0)
		require.ErrorContains(t, err, "schema.NoTables", "a zero target drops nothing and says how to")
		require.Equal(t, want, b.catalog(t, b.env.Name))
		_, err = schema.MigrationPlan(ctx, b.exec, cfg, 0)
		require.ErrorContains(t, err, "schema.NoTables")

		steps, err = schema.Migrate(ctx, b.exec, cfg, schema.NoTables)
		require.NoError(t, err)
		require.Equal(t, -1, versions(steps)[len(steps)-1])
		require.Empty(t, b.catalog(t, b.env.Name), "down to 0 leaves nothing but the version table")

		_, err = schema.Migrate(ctx, b.exec, cfg, schema.Latest)
		require.NoError(t, err)
		require.Equal(t, want, b.catalog(t, b.env.Name))
		st, err := schema.MigrationStatus(ctx, b.exec, cfg)
		require.NoError(t, err)
		require.Equal(t, schema.LatestVersion(), st.Current)
		require.Len(t, st.Applied, schema.LatestVersion())
		require.Empty(t, st.Pending)

		steps, err = schema.Migrate(ctx, b.exec, cfg, schema.Latest)
		require.NoError(t, err)
		require.Empty(t, steps, "nothing to do at the latest version")
	})

	t.Run("CreatesTheSchema", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.freshSchema(t, "new"), Table: "events"}
		_, err := schema.Migrate(ctx, b.exec, cfg, schema.Latest)
		require.NoError(t, err)
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
		// Names too long for their suffixes are hashed, as Create does.
		long := schema.Config{Schema: cfg.Schema, Table: strings.Repeat("t", 60), DeadLetterTable: strings.Repeat("d", 60)}
		_, err = schema.Migrate(ctx, b.exec, long, schema.Latest)
		require.NoError(t, err)
		require.NoError(t, schema.Validate(ctx, b.exec, long))
		before := b.catalog(t, cfg.Schema)
		require.NoError(t, schema.Create(ctx, b.exec, long))
		require.Equal(t, before, b.catalog(t, cfg.Schema), "Create finds every object by the same names and adds none")
		_, err = schema.Migrate(ctx, b.exec, long, schema.NoTables)
		require.NoError(t, err, "and down finds them too")
		st, err := schema.MigrationStatus(ctx, b.exec, cfg)
		require.NoError(t, err)
		require.Equal(t, schema.LatestVersion(), st.Current)
	})

	t.Run("UpgradesTheFirstReleaseKeepingRows", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name}
		_, err := schema.Migrate(ctx, b.exec, cfg, 1)
		require.NoError(t, err)
		b.exec1(t, `INSERT INTO "`+b.env.Name+`".outbox (topic, uuid, payload, dedup_key) VALUES ('orders', 'u1', 'x', 'k1'), ('users', 'u2', 'y', NULL)`)
		_, err = schema.Migrate(ctx, b.exec, cfg, schema.Latest)
		require.NoError(t, err)
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
		var groups, bindings string
		require.NoError(t, b.env.Pool.QueryRow(ctx, `SELECT string_agg(topic || ':' || consumer_group, ',' ORDER BY topic) FROM "`+b.env.Name+`".outbox`).Scan(&groups))
		require.Equal(t, "orders:,users:", groups)
		require.NoError(t, b.env.Pool.QueryRow(ctx, `SELECT string_agg(topic || ':' || consumer_group, ',' ORDER BY topic) FROM "`+b.env.Name+`".outbox_bindings`).Scan(&bindings))
		require.Equal(t, "orders:,users:", bindings, "the default group is bound to the topics that had rows")
	})

	t.Run("DownFromGroupsRefusesNamedGroupRows", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name}
		_, err := schema.Migrate(ctx, b.exec, cfg, schema.Latest)
		require.NoError(t, err)
		b.exec1(t, `INSERT INTO "`+b.env.Name+`".outbox (topic, consumer_group, uuid, payload, ordering_key) VALUES ('orders', 'billing', 'u1', 'x', 'k1')`)

		// Each step commits on its own: version 3's refusal is checked
		// before version 7 is undone, or 7 to 4 would be undone (and the
		// ordering keys dropped) for a target never reached.
		plan, err := schema.MigrationPlan(ctx, b.exec, cfg, 2)
		require.ErrorContains(t, err, "version 3 (consumer_groups) cannot be undone")
		require.ErrorContains(t, err, "holds messages of named consumer groups")
		require.Empty(t, plan, "the dry run reports the refusal")
		for _, target := range []int{2, schema.NoTables} {
			steps, err := schema.Migrate(ctx, b.exec, cfg, target)
			require.ErrorContains(t, err, "holds messages of named consumer groups")
			require.ErrorContains(t, err, "refused before the first step: nothing was undone, the outbox stays at version 7")
			require.Empty(t, steps, "target %d: nothing undone", target)
		}
		st, err := schema.MigrationStatus(ctx, b.exec, cfg)
		require.NoError(t, err)
		require.Equal(t, schema.LatestVersion(), st.Current)
		var key string
		require.NoError(t, b.env.Pool.QueryRow(ctx, `SELECT ordering_key FROM "`+b.env.Name+`".outbox`).Scan(&key))
		require.Equal(t, "k1", key, "version 4 was not undone")

		// Down to 3 does not undo version 3: no refusal.
		steps, err := schema.Migrate(ctx, b.exec, cfg, 3)
		require.NoError(t, err)
		require.Equal(t, []int{-7, -6, -5, -4}, versions(steps))
	})

	t.Run("ConcurrentMigrationsApplyEachVersionOnce", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name}
		var mu sync.Mutex
		var all []int
		errs := createConcurrently(4, func() error {
			steps, err := schema.Migrate(ctx, b.exec, cfg, schema.Latest)
			mu.Lock()
			all = append(all, versions(steps)...)
			mu.Unlock()
			return err
		})
		for _, err := range errs {
			require.NoError(t, err)
		}
		slices.Sort(all)
		want := make([]int, schema.LatestVersion())
		for i := range want {
			want[i] = i + 1
		}
		require.Equal(t, want, all, "every version applied once, by one of them")
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
	})

	t.Run("PlanIsADryRun", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name}
		plan, err := schema.MigrationPlan(ctx, b.exec, cfg, 2)
		require.NoError(t, err)
		require.Equal(t, []int{1, 2}, versions(plan))
		require.Contains(t, strings.Join(plan[0].Statements, "\n"), "CREATE TABLE IF NOT EXISTS")
		require.Empty(t, b.catalog(t, b.env.Name))
		require.False(t, exists(t, b.env.Pool, b.env.Name, "outbox_schema_version"), "a plan creates nothing")
		_, err = schema.MigrationPlan(ctx, b.exec, cfg, schema.LatestVersion()+1)
		require.ErrorContains(t, err, "out of range")
	})

	// A deploy rolled back after a newer release migrated the outbox: this
	// release's Migrate and MigrationPlan say so, up or down, where they
	// indexed past their list of migrations and panicked, inside a
	// transaction that then kept its connection and the outbox's lock.
	t.Run("NewerRecordedVersionIsRefused", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name}
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		newer := schema.LatestVersion() + 1
		_, err := b.env.Pool.Exec(ctx, `INSERT INTO `+b.env.Name+`.outbox_schema_version (version, name) VALUES ($1, 'from a newer release')`, newer)
		require.NoError(t, err)
		for _, target := range []int{schema.Latest, 3} {
			_, err := schema.MigrationPlan(ctx, b.exec, cfg, target)
			require.ErrorIs(t, err, schema.ErrNewerVersion)
			_, err = schema.Migrate(ctx, b.exec, cfg, target)
			require.ErrorIs(t, err, schema.ErrNewerVersion)
			require.ErrorContains(t, err, fmt.Sprintf("records version %d, this release knows versions up to %d", newer, schema.LatestVersion()))
		}
		st, err := schema.MigrationStatus(ctx, b.exec, cfg)
		require.NoError(t, err)
		require.Equal(t, newer, st.Current)
		require.Empty(t, st.Pending)
		require.Zero(t, b.env.Pool.Stat().AcquiredConns(), "no transaction left open")
	})

	// A service's own outbox table under the default name is no pgoutbox
	// outbox of any version: Baseline once recorded it as version 1, and
	// migrating up then altered it (added columns, committed) before
	// failing; Create blamed a privilege. Each refuses now, naming the
	// table and what to do, and leaves it as it was.
	t.Run("ATableOfYourOwnIsNoOutbox", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name, NoDeadLetterTable: true}
		_, err := b.env.Pool.Exec(ctx, `CREATE TABLE `+b.env.Name+`.outbox (id serial PRIMARY KEY, aggregate text, body jsonb)`)
		require.NoError(t, err)
		columns := func() []string {
			var cols []string
			require.NoError(t, b.env.Pool.QueryRow(ctx, `SELECT array_agg(column_name::text ORDER BY ordinal_position) FROM information_schema.columns
				WHERE table_schema = $1 AND table_name = 'outbox'`, b.env.Name).Scan(&cols))
			return cols
		}
		want := columns()
		const says = "without columns every pgoutbox outbox has"
		_, err = schema.Baseline(ctx, b.exec, cfg)
		require.ErrorContains(t, err, says)
		_, err = schema.BaselinePlan(ctx, b.exec, cfg)
		require.ErrorContains(t, err, says)
		require.ErrorContains(t, schema.Create(ctx, b.exec, cfg), says)
		_, err = schema.Migrate(ctx, b.exec, cfg, schema.Latest)
		require.ErrorIs(t, err, schema.ErrNoVersion, "nothing recorded, nothing run")
		require.Equal(t, want, columns(), "the table is as it was")
	})

	t.Run("CreateRecordsTheLatestVersion", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name, NoDeadLetterTable: true}
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		st, err := schema.MigrationStatus(ctx, b.exec, cfg)
		require.NoError(t, err)
		require.Equal(t, schema.LatestVersion(), st.Current)
		steps, err := schema.Migrate(ctx, b.exec, cfg, 3)
		require.NoError(t, err)
		require.Equal(t, []int{-7, -6, -5, -4}, versions(steps))
		require.NoError(t, schema.Create(ctx, b.exec, cfg), "Create upgrades a migrated outbox and records it")
		st, err = schema.MigrationStatus(ctx, b.exec, cfg)
		require.NoError(t, err)
		require.Equal(t, schema.LatestVersion(), st.Current)
	})

	t.Run("ArrivalsUpAndDown", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name, Arrivals: true}
		_, err := schema.Migrate(ctx, b.exec, cfg, 6)
		require.NoError(t, err)
		require.False(t, exists(t, b.env.Pool, b.env.Name, "outbox_arrivals"))
		steps, err := schema.Migrate(ctx, b.exec, cfg, schema.Latest)
		require.NoError(t, err)
		require.Equal(t, []int{7}, versions(steps)[:1])
		require.NoError(t, schema.Validate(ctx, b.exec, cfg), "version 7 is what an outbox with Arrivals needs")

		b.exec1(t, `INSERT INTO "`+b.env.Name+`".outbox_arrivals (topic, uuid, payload) VALUES ('orders', 'u1', 'x')`)
		_, err = schema.Migrate(ctx, b.exec, cfg, 6)
		require.ErrorContains(t, err, "holds messages that version 6 has no place for")
		_, err = schema.MigrationPlan(ctx, b.exec, cfg, schema.NoTables)
		require.ErrorContains(t, err, "version 7 (arrivals) cannot be undone", "the dry run reports the refusal")
		st, err := schema.MigrationStatus(ctx, b.exec, cfg)
		require.NoError(t, err)
		require.Equal(t, schema.LatestVersion(), st.Current, "the refused step rolled back")

		b.exec1(t, `DELETE FROM "`+b.env.Name+`".outbox_arrivals`)
		steps, err = schema.Migrate(ctx, b.exec, cfg, 6)
		require.NoError(t, err)
		require.Equal(t, -7, versions(steps)[len(steps)-1])
		require.False(t, exists(t, b.env.Pool, b.env.Name, "outbox_arrivals"))
	})

	t.Run("BaselineRecordsAnUnversionedLayout", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		for _, v := range []int{1, 2, 3, 4, 5, 6, 7} {
			cfg := schema.Config{Schema: b.env.Name, Table: "t" + string(rune('0'+v))}
			_, err := schema.Migrate(ctx, b.exec, cfg, v)
			require.NoError(t, err)
			b.exec1(t, `DROP TABLE "`+b.env.Name+`"."`+cfg.Table+`_schema_version"`)
			_, err = schema.Migrate(ctx, b.exec, cfg, schema.Latest)
			require.ErrorIs(t, err, schema.ErrNoVersion)
			require.ErrorContains(t, err, "migrate baseline")

			// The dry run, for goose and golang-migrate: it records nothing.
			l, err := schema.BaselinePlan(ctx, b.exec, cfg)
			require.NoError(t, err)
			require.Equal(t, schema.BaselineLayout{Version: v}, l)
			require.Equal(t, v, l.ToolVersion())
			require.False(t, exists(t, b.env.Pool, b.env.Name, cfg.Table+"_schema_version"), "BaselinePlan records nothing")

			got, err := schema.Baseline(ctx, b.exec, cfg)
			require.NoError(t, err)
			require.Equal(t, v, got)
			_, err = schema.Baseline(ctx, b.exec, cfg)
			require.ErrorContains(t, err, "already records version")
			_, err = schema.BaselinePlan(ctx, b.exec, cfg)
			require.ErrorContains(t, err, "already records version")
			_, err = schema.Migrate(ctx, b.exec, cfg, schema.Latest)
			require.NoError(t, err)
			require.NoError(t, schema.Validate(ctx, b.exec, cfg))
		}
		_, err := schema.Baseline(ctx, b.exec, schema.Config{Schema: b.env.Name, Table: "none"})
		require.ErrorContains(t, err, "does not exist")

		// The first release made no dead-letter table by default:
		// Baseline makes it for version 1, and refuses for later layouts.
		first := schema.Config{Schema: b.env.Name, Table: "first"}
		_, err = schema.Migrate(ctx, b.exec, schema.Config{Schema: first.Schema, Table: first.Table, NoDeadLetterTable: true}, 1)
		require.NoError(t, err)
		b.exec1(t, `DROP TABLE "`+b.env.Name+`".first_schema_version`)
		l, err := schema.BaselinePlan(ctx, b.exec, first)
		require.NoError(t, err)
		require.Equal(t, schema.BaselineLayout{Version: 1, DeadLetterTableMissing: true}, l)
		require.Equal(t, 0, l.ToolVersion(), "a migration tool runs version 1 again, which makes the dead-letter table")
		require.False(t, exists(t, b.env.Pool, b.env.Name, "first_dlq"), "BaselinePlan creates nothing")
		got, err := schema.Baseline(ctx, b.exec, first)
		require.NoError(t, err)
		require.Equal(t, 1, got)
		_, err = schema.Migrate(ctx, b.exec, first, schema.Latest)
		require.NoError(t, err)
		require.NoError(t, schema.Validate(ctx, b.exec, first))

		later := schema.Config{Schema: b.env.Name, Table: "later", NoDeadLetterTable: true}
		_, err = schema.Migrate(ctx, b.exec, later, 2)
		require.NoError(t, err)
		b.exec1(t, `DROP TABLE "`+b.env.Name+`".later_schema_version`)
		_, err = schema.Baseline(ctx, b.exec, schema.Config{Schema: later.Schema, Table: later.Table})
		require.ErrorContains(t, err, "dead-letter table")
		require.ErrorContains(t, err, "--no-dlq")
		_, err = schema.BaselinePlan(ctx, b.exec, schema.Config{Schema: later.Schema, Table: later.Table})
		require.ErrorContains(t, err, "--no-dlq")
		l, err = schema.BaselinePlan(ctx, b.exec, later)
		require.NoError(t, err)
		require.Equal(t, schema.BaselineLayout{Version: 2}, l)

		// A rotating outbox (the script of schema.SQL records no version)
		// has no arrivals: its layout is the latest version's, and
		// nothing stays pending (Baseline recorded 6, and Migrate then
		// refused the rest as a step a rotating outbox cannot take).
		ring := schema.Config{Schema: b.env.Name, Table: "ring", Rotating: true}
		require.NoError(t, schema.Create(ctx, b.exec, ring))
		b.exec1(t, `DROP TABLE "`+b.env.Name+`".ring_schema_version`)
		got, err = schema.Baseline(ctx, b.exec, ring)
		require.NoError(t, err)
		require.Equal(t, schema.LatestVersion(), got)
		steps, err := schema.Migrate(ctx, b.exec, ring, schema.Latest)
		require.NoError(t, err)
		require.Empty(t, steps)
		st, err := schema.MigrationStatus(ctx, b.exec, ring)
		require.NoError(t, err)
		require.Equal(t, schema.LatestVersion(), st.Current)
	})
}
