package schema_test

import (
	"fmt"
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
