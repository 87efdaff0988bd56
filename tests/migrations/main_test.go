package migrations_test

import (
	"testing"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// TestMain fails the run when a test leaves a schema behind.
func TestMain(m *testing.M) { pgoutboxtest.Main(m) }
