module gpudra.local/kindvalidate

go 1.22

require (
	github.com/evanphx/json-patch/v5 v5.6.0
	github.com/pelletier/go-toml v1.9.5
	go.yaml.in/yaml/v3 v3.0.4
	sigs.k8s.io/kind v0.33.0
	sigs.k8s.io/yaml v1.4.0
)

require github.com/pkg/errors v0.9.1 // indirect
