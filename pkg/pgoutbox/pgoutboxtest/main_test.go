package pgoutboxtest_test

import (
	"testing"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// TestMain drops the reused schemas and fails the run if a schema was left.
func TestMain(m *testing.M) { pgoutboxtest.Main(m) }
