package schema_test

import (
	"testing"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// TestMain fails the run if a test left a schema behind (NewSchema's or
// one of freshSchema's, which share its prefix).
func TestMain(m *testing.M) { pgoutboxtest.Main(m) }
