// Package drivers_test runs pgoutbox through database/sql drivers other
// than pgx's: lib/pq before v1.11, which hands Go slices to database/sql's
// default conversion (it refuses them) and returns timestamps and errors
// in its own forms. A module of its own, so the library does not depend
// on lib/pq.
package drivers_test

import (
	"testing"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// TestMain fails the run when a test leaves a schema behind.
func TestMain(m *testing.M) { pgoutboxtest.Main(m) }
