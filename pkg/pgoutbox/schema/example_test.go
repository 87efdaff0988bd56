package schema_test

import (
	"fmt"
	"io/fs"
	"strings"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
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
}
