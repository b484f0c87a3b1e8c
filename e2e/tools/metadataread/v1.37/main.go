// Command metadataread reads a DRA device metadata file as a workload reads it, with
// the reader of k8s.io/dynamic-resource-allocation v0.37 (Kubernetes 1.37), and prints
// what it decoded as JSON: the version it chose, the object, and what the API's own
// validation of that object said. gpudra's tests run it on the files the node agent
// writes, so that the upstream reader, not gpudra's idea of it, judges them.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/dynamic-resource-allocation/api/metadata"
	"k8s.io/dynamic-resource-allocation/devicemetadata"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: metadataread FILE")
		os.Exit(2)
	}
	f, err := os.Open(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer f.Close()
	var dm metadata.DeviceMetadata
	var invalid error
	var gvk schema.GroupVersionKind
	err = devicemetadata.DecodeMetadataFromStream(
		json.NewDecoder(f), &dm,
		devicemetadata.DecodeMetadataWithValidationResult(&invalid),
		devicemetadata.DecodeMetadataStoreGVKResult(&gvk),
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	validation := ""
	if invalid != nil {
		validation = invalid.Error()
	}
	out := map[string]any{
		"apiVersion": gvk.GroupVersion().String(),
		"object":     dm,
		"validation": validation,
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
