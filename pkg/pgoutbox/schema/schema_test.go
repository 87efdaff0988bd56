package schema_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// testBundle is one test's slice of the database.
type testBundle struct {
	env  *pgoutboxtest.Schema
	exec tx.Executor
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	env := pgoutboxtest.NewSchema(t, pgoutboxtest.Options{})
	return &testBundle{env: env, exec: tx.FromPgxPool(env.Pool)}
}

// freshSchema returns the name of a schema that does not exist yet and is
// dropped when the test ends, so Create has to make it.
func (b *testBundle) freshSchema(t *testing.T, suffix string) string {
	t.Helper()
	name := b.env.Name + "_" + suffix
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := b.env.Pool.Exec(ctx, `DROP SCHEMA IF EXISTS "`+name+`" CASCADE`)
		require.NoError(t, err)
	})
	return name
}

// exists reports whether schema.table exists, as seen by q.
func exists(t *testing.T, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, schemaName, table string) bool {
	t.Helper()
	var ok bool
	require.NoError(t, q.QueryRow(context.Background(),
		`SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL`, schemaName, table).Scan(&ok))
	return ok
}

func (b *testBundle) exec1(t *testing.T, sql string) {
	t.Helper()
	_, err := b.env.Pool.Exec(context.Background(), sql)
	require.NoError(t, err)
}

func validationError(t *testing.T, err error) *schema.ValidationError {
	t.Helper()
	require.Error(t, err)
	var verr *schema.ValidationError
	require.True(t, errors.As(err, &verr), "want a *schema.ValidationError, got %T: %v", err, err)
	return verr
}

// requireProblem asserts that exactly one problem mentions every fragment.
func requireProblem(t *testing.T, problems []string, fragments ...string) {
	t.Helper()
	n := 0
	for _, p := range problems {
		all := true
		for _, f := range fragments {
			all = all && strings.Contains(p, f)
		}
		if all {
			n++
		}
	}
	require.Equal(t, 1, n, "want one problem mentioning %q, got %q", fragments, problems)
}

func TestSQL(t *testing.T) {
	t.Parallel()

	t.Run("QuotesEveryIdentifier", func(t *testing.T) {
		t.Parallel()
		// Mixed case only survives when quoted; a reserved word would not
		// even parse unquoted.
		script, err := schema.SQL(schema.Config{Schema: "Sales", Table: "Order", DeadLetterTable: "Order_dlq"})
		require.NoError(t, err)
		require.Contains(t, script, `WHERE nspname = 'Sales') THEN
        CREATE SCHEMA IF NOT EXISTS "Sales"`)
		require.Contains(t, script, `CREATE TABLE IF NOT EXISTS "Sales"."Order" (`)
		require.Contains(t, script, `CREATE TABLE IF NOT EXISTS "Sales"."Order_dlq" (`)
		for _, name := range []string{"Sales", "Order"} {
			for _, loc := range regexp.MustCompile(name).FindAllStringIndex(script, -1) {
				require.Greater(t, loc[0], 0)
				if script[loc[0]-1] == '\'' {
					continue // the literal the schema's existence check compares with
				}
				require.Equal(t, byte('"'), script[loc[0]-1],
					"%s is not quoted at offset %d: %q", name, loc[0], script[max(0, loc[0]-20):loc[1]])
			}
		}
	})

	t.Run("PartialIndexesAndStorageParameters", func(t *testing.T) {
		t.Parallel()
		script, err := schema.SQL(schema.Config{Schema: "s", Table: "outbox"})
		require.NoError(t, err)
		for _, want := range []string{
			`CREATE INDEX IF NOT EXISTS "outbox_group_ready_idx" ON "s"."outbox" (topic, consumer_group, available_at, id) WHERE lease_token IS NULL`,
			`CREATE INDEX IF NOT EXISTS "outbox_group_lease_idx" ON "s"."outbox" (topic, consumer_group, leased_until) WHERE lease_token IS NOT NULL`,
			`CREATE UNIQUE INDEX IF NOT EXISTS "outbox_group_dedup_idx" ON "s"."outbox" (topic, consumer_group, dedup_key) WHERE dedup_key IS NOT NULL`,
			`CREATE TABLE "s"."outbox_bindings" (`,
			`autovacuum_vacuum_scale_factor = 0.01`,
			`autovacuum_vacuum_insert_scale_factor = 0.01`,
			`autovacuum_analyze_scale_factor = 0.02`,
		} {
			require.Contains(t, script, want)
		}
	})

	t.Run("DeadLetterTableByDefaultUnlessOptedOut", func(t *testing.T) {
		t.Parallel()
		byDefault, err := schema.SQL(schema.Config{Table: "jobs"})
		require.NoError(t, err)
		require.Contains(t, byDefault, `CREATE TABLE IF NOT EXISTS "public"."jobs_dlq" (`)

		without, err := schema.SQL(schema.Config{Table: "jobs", NoDeadLetterTable: true})
		require.NoError(t, err)
		require.NotContains(t, without, "jobs_dlq")
		require.Equal(t, 4, strings.Count(without, "CREATE TABLE"), "the outbox, its bindings, its paused groups and its arrivals: %s", without)

		_, err = schema.SQL(schema.Config{Table: "jobs", DeadLetterTable: "d", NoDeadLetterTable: true})
		require.ErrorIs(t, err, schema.ErrInvalidName)
		require.Contains(t, err.Error(), "set one of them")

		with, err := schema.SQL(schema.Config{Table: "jobs", DeadLetterTable: "jobs_dead"})
		require.NoError(t, err)
		require.Equal(t, 5, strings.Count(with, "CREATE TABLE"), with)
		require.Contains(t, with, `CREATE TABLE IF NOT EXISTS "public"."jobs_dead" (`)
		require.Contains(t, with, "failure_reason")
		require.Contains(t, with, `CREATE INDEX IF NOT EXISTS "jobs_dead_topic_failed_at_idx" ON "public"."jobs_dead" (topic, failed_at)`)
	})

	t.Run("EmptyPartsAreDefaulted", func(t *testing.T) {
		t.Parallel()
		script, err := schema.SQL(schema.Config{})
		require.NoError(t, err)
		require.Contains(t, script, `CREATE TABLE IF NOT EXISTS "public"."outbox" (`)
		require.NotContains(t, script, "CREATE SCHEMA", "public exists already")
	})

	t.Run("InvalidNames", func(t *testing.T) {
		t.Parallel()
		bad := []string{"bad name", "1abc", strings.Repeat("a", 64), `x";drop`, "a.b", "é"}
		fields := map[string]func(string) schema.Config{
			"schema": func(v string) schema.Config { return schema.Config{Schema: v} },
			"table":  func(v string) schema.Config { return schema.Config{Table: v, DeadLetterTable: "dlq"} },
			"dlq":    func(v string) schema.Config { return schema.Config{DeadLetterTable: v} },
		}
		for field, cfg := range fields {
			for _, v := range bad {
				script, err := schema.SQL(cfg(v))
				require.ErrorIs(t, err, schema.ErrInvalidName, "%s %q", field, v)
				require.Empty(t, script)
				require.Contains(t, err.Error(), fmt.Sprintf("%q", v), "the error must name the value")
				require.ErrorIs(t, cfg(v).Validate(), schema.ErrInvalidName)
			}
		}
		// 63 bytes is PostgreSQL's limit and still fine.
		_, err := schema.SQL(schema.Config{Table: strings.Repeat("a", 63), DeadLetterTable: "dlq"})
		require.NoError(t, err)
		// The default dead-letter name must fit too; the error says how.
		_, err = schema.SQL(schema.Config{Table: strings.Repeat("a", 63)})
		require.ErrorIs(t, err, schema.ErrInvalidName)
		require.Contains(t, err.Error(), "choose a shorter name")
	})

	t.Run("DeadLetterTableIsNotTheOutbox", func(t *testing.T) {
		t.Parallel()
		_, err := schema.SQL(schema.Config{Table: "outbox", DeadLetterTable: "outbox"})
		require.ErrorIs(t, err, schema.ErrInvalidName)
		require.Contains(t, err.Error(), `"outbox"`)
	})

	t.Run("SeveralInvalidNamesAtOnce", func(t *testing.T) {
		t.Parallel()
		_, err := schema.SQL(schema.Config{Schema: "1s", Table: "t t", DeadLetterTable: "d-d"})
		require.ErrorIs(t, err, schema.ErrInvalidName)
		for _, v := range []string{`"1s"`, `"t t"`, `"d-d"`} {
			require.Contains(t, err.Error(), v)
		}
	})
}

// TestSQLAppliesAndValidates runs the migration script as a migration tool
// would: it must apply, apply again, and satisfy Validate.
func TestSQLAppliesAndValidates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := schema.Config{Schema: b.freshSchema(t, "mig"), Table: "Outbox", DeadLetterTable: "Outbox_dlq"}
	script, err := schema.SQL(cfg)
	require.NoError(t, err)
	b.exec1(t, script)
	b.exec1(t, script)
	require.NoError(t, schema.Validate(context.Background(), b.exec, cfg))
}

func TestCreate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("Idempotent", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.freshSchema(t, "idem"), Table: "outbox", DeadLetterTable: "outbox_dlq"}
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
		require.True(t, exists(t, b.env.Pool, cfg.Schema, "outbox_dlq"))
	})

	t.Run("ConcurrentWithPool", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.freshSchema(t, "conc"), Table: "outbox", DeadLetterTable: "outbox_dlq"}
		errs := createConcurrently(8, func() error { return schema.Create(ctx, b.exec, cfg) })
		for i, err := range errs {
			require.NoError(t, err, "goroutine %d", i)
		}
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
	})

	t.Run("ConcurrentWithCallerTx", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.freshSchema(t, "conctx"), Table: "outbox"}
		errs := createConcurrently(8, func() error {
			t, err := b.env.Pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = t.Rollback(ctx) }()
			if err := schema.Create(ctx, tx.FromPgxTx(t), cfg); err != nil {
				return err
			}
			return t.Commit(ctx)
		})
		for i, err := range errs {
			require.NoError(t, err, "goroutine %d", i)
		}
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
	})

	// Package doc: "safe to call from several processes at once". Two
	// services that keep different outboxes in one new schema start together.
	t.Run("ConcurrentDifferentTablesInOneNewSchema", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		s := b.freshSchema(t, "multi")
		errs := createConcurrently(8, func() func() error {
			var i int
			var mu sync.Mutex
			return func() error {
				mu.Lock()
				i++
				cfg := schema.Config{Schema: s, Table: fmt.Sprintf("outbox_%d", i)}
				mu.Unlock()
				return schema.Create(ctx, b.exec, cfg)
			}
		}())
		for i, err := range errs {
			require.NoError(t, err, "goroutine %d", i)
		}
		for i := 1; i <= 8; i++ {
			require.True(t, exists(t, b.env.Pool, s, fmt.Sprintf("outbox_%d", i)))
		}
	})

	t.Run("InCallerTxRollsBackWithIt", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.freshSchema(t, "rb"), Table: "outbox", DeadLetterTable: "outbox_dlq"}
		ptx, err := b.env.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = ptx.Rollback(ctx) }()
		require.NoError(t, schema.Create(ctx, tx.FromPgxTx(ptx), cfg))
		require.NoError(t, schema.Validate(ctx, tx.FromPgxTx(ptx), cfg), "visible inside the transaction")
		require.False(t, exists(t, b.env.Pool, cfg.Schema, "outbox"), "Create must not commit the caller's transaction")
		require.NoError(t, ptx.Rollback(ctx))
		require.False(t, exists(t, b.env.Pool, cfg.Schema, "outbox"))
		require.False(t, exists(t, b.env.Pool, cfg.Schema, "outbox_dlq"))
		var schemaExists bool
		require.NoError(t, b.env.Pool.QueryRow(ctx,
			`SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, cfg.Schema).Scan(&schemaExists))
		require.False(t, schemaExists, "CREATE SCHEMA ran in the caller's transaction too")
	})

	t.Run("InCallerTxCommitsWithIt", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name, Table: "outbox"}
		ptx, err := b.env.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = ptx.Rollback(ctx) }()
		require.NoError(t, schema.Create(ctx, tx.FromPgxTx(ptx), cfg))
		require.NoError(t, schema.Create(ctx, tx.FromPgxTx(ptx), cfg), "idempotent inside one transaction")
		require.True(t, exists(t, ptx, cfg.Schema, "outbox"))
		require.False(t, exists(t, b.env.Pool, cfg.Schema, "outbox"))
		require.NoError(t, ptx.Commit(ctx))
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
	})

	t.Run("InvalidNameTouchesNothing", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		err := schema.Create(ctx, b.exec, schema.Config{Schema: b.env.Name, Table: `x";drop`})
		require.ErrorIs(t, err, schema.ErrInvalidName)
		err = schema.Validate(ctx, b.exec, schema.Config{Schema: b.env.Name, Table: "1abc"})
		require.ErrorIs(t, err, schema.ErrInvalidName)
		var n int
		require.NoError(t, b.env.Pool.QueryRow(ctx,
			`SELECT count(*) FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace WHERE ns.nspname = $1`,
			b.env.Name).Scan(&n))
		require.Zero(t, n)
	})
}

// createConcurrently runs fn in n goroutines released at once and returns
// their errors.
func createConcurrently(n int, fn func() error) []error {
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			errs[i] = fn()
		})
	}
	close(start)
	wg.Wait()
	return errs
}

func TestValidate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// An index a failed CREATE INDEX CONCURRENTLY left invalid is there by
	// name, unused by the planner and skipped by IF NOT EXISTS: Validate
	// names it and what to do, where it said the schema was fine.
	t.Run("NamesAnInvalidIndex", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name}
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		_, err := b.env.Pool.Exec(ctx, `UPDATE pg_index SET indisvalid = false WHERE indexrelid = $1::regclass`, b.env.Name+".outbox_group_dedup_idx")
		require.NoError(t, err)
		err = schema.Validate(ctx, b.exec, cfg)
		var verr *schema.ValidationError
		require.ErrorAs(t, err, &verr)
		require.Len(t, verr.Problems, 1)
		require.Contains(t, verr.Problems[0], "index outbox_group_dedup_idx on outbox is invalid")
		require.Contains(t, verr.Problems[0], "DROP INDEX CONCURRENTLY")
		// Create (AutoInitializeSchema) builds it again, where IF NOT
		// EXISTS took it for built.
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
	})

	// An index of pgoutbox's name with another definition (the dedup
	// index not unique, the ready index without its predicate) passed:
	// keyed and scheduled publishes then failed, and their error pointed
	// back at a validation that said the schema was fine.
	t.Run("NamesAnIndexOfAnotherDefinition", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name}
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		q := `"` + b.env.Name + `".`
		b.exec1(t, `DROP INDEX `+q+`outbox_group_dedup_idx`)
		b.exec1(t, `CREATE INDEX outbox_group_dedup_idx ON `+q+`outbox (topic, consumer_group, dedup_key) WHERE dedup_key IS NOT NULL`)
		b.exec1(t, `DROP INDEX `+q+`outbox_group_ready_idx`)
		b.exec1(t, `CREATE INDEX outbox_group_ready_idx ON `+q+`outbox (topic, consumer_group, available_at, id)`)
		verr := validationError(t, schema.Validate(ctx, b.exec, cfg))
		require.Len(t, verr.Problems, 2, "%q", verr.Problems)
		requireProblem(t, verr.Problems, "outbox_group_dedup_idx", "want UNIQUE btree (topic, consumer_group, dedup_key) WHERE dedup_key IS NOT NULL", "schema.Create")
		requireProblem(t, verr.Problems, "outbox_group_ready_idx", "WHERE lease_token IS NULL")
		// Create kept them (IF NOT EXISTS), and an application role's
		// Create at the latest version took the shortcut past them.
		require.NoError(t, schema.Create(ctx, b.exec, cfg), "the fix the problem names")
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
	})

	// A rotating outbox with a partition of its ring dropped passed, and
	// Create did not make it again: the ring stopped turning.
	t.Run("NamesAMissingPartitionOfTheRing", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name, Rotating: true}
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
		b.exec1(t, `DROP TABLE "`+b.env.Name+`".outbox_g1`)
		verr := validationError(t, schema.Validate(ctx, b.exec, cfg))
		require.Len(t, verr.Problems, 1, "%q", verr.Problems)
		requireProblem(t, verr.Problems, "partition outbox_g1", "schema.Create", "ATTACH PARTITION")
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		require.NoError(t, schema.Validate(ctx, b.exec, cfg), "Create made it again")
	})

	t.Run("PassesAfterCreate", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name, Table: "outbox", DeadLetterTable: "outbox_dlq"}
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
		// The same check through a transaction.
		ptx, err := b.env.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = ptx.Rollback(ctx) }()
		require.NoError(t, schema.Validate(ctx, tx.FromPgxTx(ptx), cfg))
	})

	t.Run("ReportsEveryProblemByName", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name, Table: "outbox"}
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		q := `"` + b.env.Name + `"."outbox"`
		b.exec1(t, `ALTER TABLE `+q+` DROP COLUMN last_error`)
		b.exec1(t, `ALTER TABLE `+q+` ALTER COLUMN payload TYPE text`)
		b.exec1(t, `DROP INDEX "`+b.env.Name+`"."outbox_group_lease_idx"`)

		err := schema.Validate(ctx, b.exec, cfg)
		verr := validationError(t, err)
		require.Len(t, verr.Problems, 3, "%q", verr.Problems)
		requireProblem(t, verr.Problems, "last_error", "missing")
		requireProblem(t, verr.Problems, "payload", "text", "bytea")
		requireProblem(t, verr.Problems, "outbox_group_lease_idx", "missing")
		for _, frag := range []string{"last_error", "payload", "outbox_group_lease_idx", "schema.Create"} {
			require.Contains(t, err.Error(), frag, "one error names everything and the fix")
		}
	})

	t.Run("MissingDeadLetterTableSaysHowToDoWithout", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.NoError(t, schema.Create(ctx, b.exec, schema.Config{Schema: b.env.Name, Table: "outbox", NoDeadLetterTable: true}))
		err := schema.Validate(ctx, b.exec, schema.Config{Schema: b.env.Name, Table: "outbox"})
		verr := validationError(t, err)
		requireProblem(t, verr.Problems, "outbox_dlq is missing", "NoDeadLetterTable", "--no-dlq")
		require.ErrorContains(t, err, "pgoutbox schema apply", "the command that makes what is missing at the latest version")
	})

	t.Run("MissingTable", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		err := schema.Validate(ctx, b.exec, schema.Config{Schema: b.env.Name, Table: "nowhere"})
		verr := validationError(t, err)
		requireProblem(t, verr.Problems, "table "+b.env.Name+".nowhere is missing")
	})

	t.Run("MissingSchema", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		err := schema.Validate(ctx, b.exec, schema.Config{Schema: b.env.Name + "_none", Table: "outbox"})
		verr := validationError(t, err)
		requireProblem(t, verr.Problems, "table "+b.env.Name+"_none.outbox is missing")
	})

	t.Run("ExtraColumnsAndIndexesAreAllowed", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name, Table: "outbox", DeadLetterTable: "outbox_dlq"}
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		q := `"` + b.env.Name + `"."outbox"`
		b.exec1(t, `ALTER TABLE `+q+` ADD COLUMN tenant text`)
		b.exec1(t, `CREATE INDEX outbox_tenant_idx ON `+q+` (tenant)`)
		b.exec1(t, `ALTER TABLE "`+b.env.Name+`"."outbox_dlq" ADD COLUMN note text`)
		require.NoError(t, schema.Validate(ctx, b.exec, cfg))
	})

	t.Run("DeadLetterTableMissing", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.NoError(t, schema.Create(ctx, b.exec, schema.Config{Schema: b.env.Name, Table: "outbox", NoDeadLetterTable: true}))
		cfg := schema.Config{Schema: b.env.Name, Table: "outbox"}
		verr := validationError(t, schema.Validate(ctx, b.exec, cfg))
		requireProblem(t, verr.Problems, "table "+b.env.Name+".outbox_dlq is missing")
		for _, p := range verr.Problems {
			require.Contains(t, p, "outbox_dlq", "only the dead-letter table is missing: %q", verr.Problems)
		}
	})

	t.Run("DeadLetterTableWrong", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg := schema.Config{Schema: b.env.Name, Table: "outbox", DeadLetterTable: "outbox_dlq"}
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		b.exec1(t, `ALTER TABLE "`+b.env.Name+`"."outbox_dlq" DROP COLUMN failure_reason`)
		b.exec1(t, `DROP INDEX "`+b.env.Name+`"."outbox_dlq_topic_failed_at_idx"`)
		verr := validationError(t, schema.Validate(ctx, b.exec, cfg))
		require.Len(t, verr.Problems, 2, "%q", verr.Problems)
		requireProblem(t, verr.Problems, "outbox_dlq.failure_reason", "missing")
		requireProblem(t, verr.Problems, "outbox_dlq_topic_failed_at_idx", "missing")
	})
}

// previousReleaseDDL is the outbox of the previous release: the table
// without lease_holder and failure_reason, its indexes, no dead-letter
// table.
func previousReleaseDDL(q string) []string {
	return []string{
		`CREATE TABLE ` + q + `."outbox" (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic        text        NOT NULL,
    uuid         text        NOT NULL,
    payload      bytea       NOT NULL,
    metadata     jsonb       NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now(),
    available_at timestamptz NOT NULL DEFAULT now(),
    deliveries   integer     NOT NULL DEFAULT 0,
    lease_token  uuid,
    leased_until timestamptz,
    leased_by    text,
    dedup_key    text,
    last_error   text
) WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02
)`,
		`CREATE INDEX "outbox_ready_idx" ON ` + q + `."outbox" (topic, available_at, id) WHERE lease_token IS NULL`,
		`CREATE INDEX "outbox_lease_idx" ON ` + q + `."outbox" (topic, leased_until) WHERE lease_token IS NOT NULL`,
		`CREATE UNIQUE INDEX "outbox_dedup_idx" ON ` + q + `."outbox" (topic, dedup_key) WHERE dedup_key IS NOT NULL`,
	}
}

// Create upgrades the outbox of the previous release in place: it adds the
// columns that release lacked (and the now default dead-letter table),
// keeping the rows.
func TestCreateUpgradesPreviousRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	q := `"` + b.env.Name + `"`
	for _, stmt := range previousReleaseDDL(q) {
		b.exec1(t, stmt)
	}
	b.exec1(t, `INSERT INTO `+q+`."outbox" (topic, uuid, payload) VALUES ('t', 'kept', 'x')`)
	cfg := schema.Config{Schema: b.env.Name, Table: "outbox"} // dead letters in outbox_dlq

	verr := validationError(t, schema.Validate(ctx, b.exec, cfg))
	require.Len(t, verr.Problems, 13, "%q", verr.Problems)
	requireProblem(t, verr.Problems, "index outbox_dedup_idx on outbox is left from the first release", "drop it")
	requireProblem(t, verr.Problems, "outbox.lease_holder", "missing", "bigint")
	requireProblem(t, verr.Problems, "outbox.failure_reason", "missing", "text")
	requireProblem(t, verr.Problems, "outbox.consumer_group", "missing", "text")
	requireProblem(t, verr.Problems, "outbox.ordering_key", "missing", "text")
	requireProblem(t, verr.Problems, "table "+b.env.Name+".outbox_dlq is missing")
	requireProblem(t, verr.Problems, "table "+b.env.Name+".outbox_bindings is missing")
	requireProblem(t, verr.Problems, "table "+b.env.Name+".outbox_paused is missing")
	for _, idx := range []string{"outbox_group_ready_idx", "outbox_group_lease_idx", "outbox_group_dedup_idx", "outbox_group_order_idx", "outbox_group_order_lease_idx"} {
		requireProblem(t, verr.Problems, "index "+idx+" ", "missing")
	}

	require.NoError(t, schema.Create(ctx, b.exec, cfg))
	require.NoError(t, schema.Validate(ctx, b.exec, cfg))
	// The old indexes are gone: the old unique dedup index would refuse a
	// keyed message's second consumer group.
	for _, old := range []string{"outbox_ready_idx", "outbox_lease_idx", "outbox_dedup_idx"} {
		require.False(t, exists(t, b.env.Pool, b.env.Name, old), old)
	}
	for col, typ := range map[string]string{"lease_holder": "bigint", "failure_reason": "text", "consumer_group": "text"} {
		var got string
		require.NoError(t, b.env.Pool.QueryRow(ctx, `SELECT format_type(atttypid, atttypmod) FROM pg_attribute
			WHERE attrelid = format('%I.%I', $1::text, 'outbox')::regclass AND attname = $2 AND NOT attisdropped`,
			b.env.Name, col).Scan(&got))
		require.Equal(t, typ, got, col)
	}
	require.True(t, exists(t, b.env.Pool, b.env.Name, "outbox_dlq"))
	var uuid, group string
	var holder, reason *string
	require.NoError(t, b.env.Pool.QueryRow(ctx, `SELECT uuid, consumer_group, lease_holder::text, failure_reason FROM `+q+`."outbox"`).
		Scan(&uuid, &group, &holder, &reason))
	require.Equal(t, "kept", uuid)
	require.Equal(t, "", group, "kept for the default group")
	require.Nil(t, holder)
	require.Nil(t, reason)
	var bound []string
	rows, err := b.env.Pool.Query(ctx, `SELECT topic || '/' || consumer_group FROM `+q+`."outbox_bindings"`)
	require.NoError(t, err)
	bound, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"t/"}, bound, "the topics with rows keep their default group bound, so a new group does not take over")

	// Upgrading needs an ACCESS EXCLUSIVE lock for a moment. Behind an open
	// transaction that holds the table, Create gives up after its lock
	// timeout with an error that says so, instead of queueing every writer
	// of the outbox behind it indefinitely.
	t.Run("GivesUpBehindALongTransaction", func(t *testing.T) {
		b2 := setup(t)
		q2 := `"` + b2.env.Name + `"`
		for _, stmt := range previousReleaseDDL(q2) {
			b2.exec1(t, stmt)
		}
		holder, err := b2.env.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = holder.Rollback(ctx) }()
		_, err = holder.Exec(ctx, `SELECT count(*) FROM `+q2+`."outbox"`) // ACCESS SHARE until it ends
		require.NoError(t, err)
		err = schema.Create(ctx, b2.exec, schema.Config{Schema: b2.env.Name, Table: "outbox"})
		require.ErrorContains(t, err, "lock_timeout (5s)")
		require.ErrorContains(t, err, "run it again when")
		require.ErrorContains(t, err, "options=-c lock_timeout=30s in the connection string", "says how to allow a longer wait")

		// A lock_timeout of the caller's is the one kept, and named.
		caller, err := b2.env.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = caller.Rollback(ctx) }()
		_, err = caller.Exec(ctx, `SET LOCAL lock_timeout = '200ms'`)
		require.NoError(t, err)
		start := time.Now()
		err = schema.Create(ctx, tx.FromPgxTx(caller), schema.Config{Schema: b2.env.Name, Table: "outbox"})
		require.ErrorContains(t, err, "lock_timeout (200ms)")
		require.Less(t, time.Since(start), 3*time.Second)
	})

	// Once up to date, Create (at every start of every instance) must not
	// lock out the writers of a live queue: no ACCESS EXCLUSIVE lock, nor
	// any other that conflicts with a writer's ROW EXCLUSIVE.
	t.Run("AgainTakesNoLockAWriterWaitsFor", func(t *testing.T) {
		ptx, err := b.env.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = ptx.Rollback(ctx) }()
		require.NoError(t, schema.Create(ctx, tx.FromPgxTx(ptx), cfg))
		rows, err := ptx.Query(ctx, `SELECT c.relname, l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
			WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation' AND c.relnamespace = $1::regnamespace
			  AND c.relname IN ('outbox', 'outbox_dlq')`, b.env.Name)
		require.NoError(t, err)
		locks, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ Table, Mode string }])
		require.NoError(t, err)
		for _, l := range locks {
			require.NotContains(t, []string{"ShareLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock"}, l.Mode,
				"Create holds %s on %s, which a writer (ROW EXCLUSIVE) waits for", l.Mode, l.Table)
		}
	})

	// The same, as it happens: a transaction that wrote to the outbox and
	// is still open does not hold Create up.
	t.Run("AgainBesideAnOpenWriter", func(t *testing.T) {
		writer, err := b.env.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = writer.Rollback(ctx) }()
		_, err = writer.Exec(ctx, `LOCK TABLE `+q+`."outbox" IN ROW EXCLUSIVE MODE`)
		require.NoError(t, err)
		createCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		require.NoError(t, schema.Create(createCtx, b.exec, cfg), "Create waited for the open writer")
	})
}

// A nil executor is an error that says what to pass, from every function
// of the package that runs statements and from tx.RunInTx; none panics.
func TestANilExecutorIsAnError(t *testing.T) {
	ctx, c := context.Background(), schema.Config{}
	calls := map[string]func() error{
		"Create":            func() error { return schema.Create(ctx, nil, c) },
		"Validate":          func() error { return schema.Validate(ctx, nil, c) },
		"Migrate":           func() error { _, err := schema.Migrate(ctx, nil, c, schema.LatestVersion()); return err },
		"MigrationStatus":   func() error { _, err := schema.MigrationStatus(ctx, nil, c); return err },
		"MigrationPlan":     func() error { _, err := schema.MigrationPlan(ctx, nil, c, schema.LatestVersion()); return err },
		"Baseline":          func() error { _, err := schema.Baseline(ctx, nil, c); return err },
		"BaselinePlan":      func() error { _, err := schema.BaselinePlan(ctx, nil, c); return err },
		"Rotate":            func() error { _, err := schema.Rotate(ctx, nil, c, time.Hour); return err },
		"IsRotating":        func() error { _, err := schema.IsRotating(ctx, nil, c); return err },
		"ConvertToRotating": func() error { return schema.ConvertToRotating(ctx, nil, c) },
		"ConvertToSingle":   func() error { return schema.ConvertToSingle(ctx, nil, c) },
		"tx.RunInTx": func() error {
			return tx.RunInTx(ctx, nil, func(tx.Executor) error { t.Fatal("fn ran"); return nil })
		},
	}
	for name, call := range calls {
		require.ErrorContains(t, call(), "executor is nil; pass tx.FromPgxPool(pool)", name)
	}
}

// A dead-letter table named as a relation the outbox names after itself
// passed Validate: Create then failed on an unrelated-looking error (the
// index or partition stood where the table should be), and a conversion
// to a rotating outbox whose dead-letter table was named as a ring
// partition "succeeded" into a ring that could never rotate. An outbox
// made on another rotating outbox's partition took its rows and indexes,
// and every Publish to it failed.
func TestNamesAnOutboxMakesAreNotTheDeadLetterTables(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, dlq := range []string{"ob_pkey", "ob_id_seq", "ob_group_ready_idx", "ob_arrivals_pkey"} {
		err := schema.Config{Table: "ob", DeadLetterTable: dlq}.Validate()
		require.ErrorIs(t, err, schema.ErrInvalidName, dlq)
		require.ErrorContains(t, err, "give it another name", dlq)
	}
	for _, dlq := range []string{"ob_g0", "ob_g2", "ob_long", "ob_generation"} {
		require.NoError(t, schema.Config{Table: "ob", DeadLetterTable: dlq}.Validate(), "a single table's, %s", dlq)
		err := schema.Config{Table: "ob", DeadLetterTable: dlq, Rotating: true}.Validate()
		require.ErrorIs(t, err, schema.ErrInvalidName, dlq)
		require.ErrorContains(t, err, "rename the dead-letter table first", dlq)
	}

	b := setup(t)
	single := schema.Config{Schema: b.freshSchema(t, "ringname"), Table: "ob", DeadLetterTable: "ob_g1"}
	require.NoError(t, schema.Create(ctx, b.exec, single))
	err := schema.ConvertToRotating(ctx, b.exec, single)
	require.ErrorIs(t, err, schema.ErrInvalidName)
	require.ErrorContains(t, err, "rename the dead-letter table first")
	require.NoError(t, schema.Validate(ctx, b.exec, single), "the single table is left as it was")

	ring := schema.Config{Schema: b.freshSchema(t, "onpartition"), Table: "outbox", Rotating: true}
	require.NoError(t, schema.Create(ctx, b.exec, ring))
	err = schema.Create(ctx, b.exec, schema.Config{Schema: ring.Schema, Table: "outbox_g0", DeadLetterTable: "other_dlq"})
	require.ErrorContains(t, err, "is a partition of")
}

// A table name of 60 bytes makes the default dead-letter table's name
// too long: the error said to choose a shorter name for a table the user
// never named. It says where the name comes from and what to set.
func TestTheDefaultDeadLetterTablesNameIsNamedAsSuch(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("t", 60)
	err := schema.Config{Table: long}.Validate()
	require.ErrorIs(t, err, schema.ErrInvalidName)
	require.ErrorContains(t, err, `DeadLetterTable is unset, so it defaults to the table's name plus "_dlq"`)
	require.NoError(t, schema.Config{Table: long, DeadLetterTable: "dlq"}.Validate())
	err = schema.Config{Table: long, DeadLetterTable: long + "_dlq"}.Validate()
	require.NotContains(t, err.Error(), "defaults to", "a name the user chose")
}

// An outbox made beside another whose name is one the first names a
// relation of its own after (an outbox "outbox_arrivals", "outbox_long",
// "outbox_bindings"): Create found the table by name and made none, so
// the first took the other's messages for its arrivals (its MoveGroup
// moved them out of the other outbox), or its ring lacked a partition and
// publishes failed. Create refuses, naming the table.
func TestCreateRefusesNamesAnotherOutboxHolds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	for _, tc := range []struct {
		other    string
		rotating bool
		role     string
	}{
		{"outbox_arrivals", false, "arrivals table"},
		{"outbox_bindings", false, "bindings table"},
		{"outbox_dlq", false, "dead-letter table"},
		{"outbox_long", true, "ring partition"},
		{"outbox_g0", true, "ring partition"},
	} {
		s := b.freshSchema(t, "taken_"+tc.other)
		require.NoError(t, schema.Create(ctx, b.exec, schema.Config{Schema: s, Table: tc.other, DeadLetterTable: "other_dlq"}))
		err := schema.Create(ctx, b.exec, schema.Config{Schema: s, Table: "outbox", Rotating: tc.rotating})
		require.ErrorContains(t, err, "which the outbox", tc.other)
		require.ErrorContains(t, err, tc.role, tc.other)
		require.NoError(t, schema.Validate(ctx, b.exec, schema.Config{Schema: s, Table: tc.other, DeadLetterTable: "other_dlq"}), "the other outbox is left as it was")
	}
	// An outbox's own arrivals table, ring and tables are its own.
	for _, rotating := range []bool{false, true} {
		cfg := schema.Config{Schema: b.freshSchema(t, fmt.Sprint("own_", rotating)), Table: "outbox", Rotating: rotating}
		require.NoError(t, schema.Create(ctx, b.exec, cfg))
		require.NoError(t, schema.Create(ctx, b.exec, cfg), "again")
	}
}

// The conversion to a rotating outbox beside an outbox named as one of its
// ring partitions "succeeded" into a ring without that partition.
func TestConvertToRotatingRefusesARingNameAnotherOutboxHolds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	s := b.freshSchema(t, "convtaken")
	require.NoError(t, schema.Create(ctx, b.exec, schema.Config{Schema: s, Table: "outbox_g0", DeadLetterTable: "other_dlq"}))
	single := schema.Config{Schema: s, Table: "outbox"}
	require.NoError(t, schema.Create(ctx, b.exec, single))
	err := schema.ConvertToRotating(ctx, b.exec, single)
	require.ErrorIs(t, err, schema.ErrInvalidName)
	require.ErrorContains(t, err, "would use as its ring partition")
	require.NoError(t, schema.Validate(ctx, b.exec, single), "the single table is left as it was")
}

// A Config of the other layout than the outbox's (Rotating set on a
// single table, unset on a rotating one): the error ended by advising
// schema.Create, which refuses that Config, after listing columns "missing"
// only because of it. It names the layout and what to set, and no more.
func TestValidateOfTheOtherLayoutSaysOnlyThat(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	single := schema.Config{Schema: b.freshSchema(t, "layout_single"), Table: "outbox"}
	ring := schema.Config{Schema: b.freshSchema(t, "layout_ring"), Table: "outbox", Rotating: true}
	require.NoError(t, schema.Create(ctx, b.exec, single))
	require.NoError(t, schema.Create(ctx, b.exec, ring))
	single.Rotating, ring.Rotating = true, false
	for _, c := range []schema.Config{single, ring} {
		err := schema.Validate(ctx, b.exec, c)
		var problems *schema.ValidationError
		require.ErrorAs(t, err, &problems)
		require.Len(t, problems.Problems, 1, "%v", err)
		require.NotContains(t, err.Error(), "which makes whatever is missing")
	}
}
