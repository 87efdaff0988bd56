package schema_test

import (
	"os"
	"testing"

	"github.com/pgoutbox/watermill-pgoutbox/internal/pgtest"
)

// TestMain fails the run if a test left a schema behind (pgtest.Setup's
// schema or one of freshSchema's, which share its prefix).
func TestMain(m *testing.M) { os.Exit(pgtest.CheckNoLeftoverSchemas(m)) }
