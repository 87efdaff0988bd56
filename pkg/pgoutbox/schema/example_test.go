package schema_test

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Example_migrationScript shows the DDL that schema.SQL hands to a migration
// tool: every identifier is quoted and every statement is idempotent.
func Example_migrationScript() {
	script, err := schema.SQL(schema.Config{Table: "outbox"})
	if err != nil {
		panic(err)
	}
	first, _, _ := strings.Cut(script, "\n")
	fmt.Println(first)
	// Output:
	// CREATE TABLE IF NOT EXISTS "public"."outbox" (
}

// ExampleMigrations lists the files a migration tool gets: one per
// version for goose (golang-migrate gets an .up.sql and a .down.sql each).
// Hand the fs.FS to goose.NewProvider(goose.DialectPostgres, db, fsys), or
// to golang-migrate's iofs.New(fsys, ".").
func ExampleMigrations() {
	fsys, err := schema.Migrations(schema.Config{Schema: "app"}, schema.FormatGoose)
	if err != nil {
		panic(err)
	}
	names, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		panic(err)
	}
	for _, name := range names {
		fmt.Println(name)
	}
	// Output:
	// 0001_initial.sql
	// 0002_lease_holder_parking.sql
	// 0003_consumer_groups.sql
	// 0004_ordering_keys.sql
	// 0005_paused_groups.sql
	// 0006_backlog_copies.sql
	// 0007_arrivals.sql
}

// ExampleMigrate creates an outbox by migration, reads its version, and
// steps one version down and up again, as "pgoutbox schema migrate" does.
// (It needs PostgreSQL: POSTGRES_DSN, or the local default.)
func ExampleMigrate() {
	ctx := context.Background()
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	tables := schema.Config{Schema: "pgoutbox_migrate_example_" + uuid.NewString()[:8]}
	defer pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{tables.Schema}.Sanitize()+" CASCADE") //nolint:errcheck
	exec := tx.FromPgxPool(pool)

	// Each step in a transaction of its own, under an advisory lock: a
	// second deploy migrating at the same time waits, then finds it done.
	steps, err := schema.Migrate(ctx, exec, tables, schema.Latest)
	if err != nil {
		panic(err)
	}
	for _, s := range steps {
		fmt.Println("applied", s.Version, s.Name)
	}
	st, err := schema.MigrationStatus(ctx, exec, tables)
	if err != nil {
		panic(err)
	}
	fmt.Printf("version %d of %d, %d pending\n", st.Current, st.Latest, len(st.Pending))

	// A dry run: what going down one version would run.
	plan, err := schema.MigrationPlan(ctx, exec, tables, st.Current-1)
	if err != nil {
		panic(err)
	}
	fmt.Println("down would undo", plan[0].Version, plan[0].Name, "in", len(plan[0].Statements), "statements")
	if err := schema.Validate(ctx, exec, tables); err != nil {
		panic(err)
	}
	// Output:
	// applied 1 initial
	// applied 2 lease_holder_parking
	// applied 3 consumer_groups
	// applied 4 ordering_keys
	// applied 5 paused_groups
	// applied 6 backlog_copies
	// applied 7 arrivals
	// version 7 of 7, 0 pending
	// down would undo 7 arrivals in 3 statements
}
