package tests

import (
	"os"
	"testing"

	"github.com/pgoutbox/watermill-pgoutbox/internal/pgtest"
)

// TestMain fails the run if a test left a schema behind.
func TestMain(m *testing.M) { os.Exit(pgtest.CheckNoLeftoverSchemas(m)) }
